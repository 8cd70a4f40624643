#!/usr/bin/env bash
# The decode step at the rank shapes with HEAD's grouped GEMM (kernel, candidates, table) and this tree's.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
mkdir -p /tmp/new && cp kernels/fp8_gemm_triton.py kernels/fp8_gemm.py kernels/fp8_gemm_tables/nvidia_h200.json /tmp/new/
use() { if [ $1 = old ]; then cp bench_tmp/old/fp8_gemm_triton.py bench_tmp/old/fp8_gemm.py kernels/; cp bench_tmp/old/nvidia_h200.json kernels/fp8_gemm_tables/;
        else cp /tmp/new/fp8_gemm_triton.py /tmp/new/fp8_gemm.py kernels/; cp /tmp/new/nvidia_h200.json kernels/fp8_gemm_tables/; fi; }
for cfg in glm5-rank-ep8 dsv32-rank-ep8; do for v in new old; do
  use $v
  timeout 150 python3 benchmarks/bench_decode.py --config $cfg --contexts 32768 --modes dense hisparse \
    --skip-model-indexer-run --miss-rates 0.05 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --out $OUT/r/${cfg}_$v.json 2>&1 | grep -v "it/s\]" > $OUT/r/${cfg}_$v.log
  echo "== $cfg $v"; grep "^dense\|^hisparse\|^mode" $OUT/r/${cfg}_$v.log | head -6
done; done
use new
timeout 200 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/kernels/test_fp8_gemm_gpu.py 2>&1 | tail -4 | tee $OUT/r/fp8_tests.txt
tar czf $OUT/results.tgz -C $OUT r
