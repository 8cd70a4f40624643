#!/usr/bin/env bash
# For the next session with an H100 (~6 minutes): re-tune the H100 table's grouped keys with 0d10512's candidates
# (the H200's were re-tuned then; the H100's keep older choices), and time the rank's step with the old table and
# the new one. Run it on the tree as committed; bring back $OUT/nvidia_h100_80gb_hbm3.json as the H100's table.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "for an H100"; exit 2; }
T=kernels/fp8_gemm_tables/nvidia_h100_80gb_hbm3.json
cp $T /tmp/h100_old.json && cp $T $OUT/nvidia_h100_80gb_hbm3.json
timeout 300 python3 benchmarks/tune_fp8_gemm.py --configs dsv32-bench-16l glm5-bench dsv32-rank-ep16 dsv32-rank-ep8 glm5-rank-ep8 \
  --parallel 1x1 --max-tokens 256 --shapes 4096:7168 7168:2048 4096:6144 6144:2048 2048:6144 2048:7168 \
  --out $OUT/nvidia_h100_80gb_hbm3.json > $OUT/r/tune.log 2>&1
grep "wrote\|Error" $OUT/r/tune.log | tail -3
for v in new old; do
  if [ $v = new ]; then cp $OUT/nvidia_h100_80gb_hbm3.json $T; else cp /tmp/h100_old.json $T; fi
  timeout 150 python3 benchmarks/bench_decode.py --config dsv32-rank-ep16 --contexts 32768 --modes dense hisparse \
    --skip-model-indexer-run --miss-rates 0.05 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --out $OUT/r/ep16_$v.json 2>&1 | grep -v "it/s\]" > $OUT/r/ep16_$v.log
  echo "== dsv32-rank-ep16 $v table"; grep "^dense\|^hisparse\|^mode" $OUT/r/ep16_$v.log
done
cp $OUT/nvidia_h100_80gb_hbm3.json $T
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/kernels/test_fp8_gemm_gpu.py 2>&1 | tail -3 | tee $OUT/r/fp8_tests.txt
tar czf $OUT/results.tgz -C $OUT r
