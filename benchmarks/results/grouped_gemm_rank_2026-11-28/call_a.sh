#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
timeout 240 python3 bench_tmp/compare.py 2>&1 | grep -v Warning | tee $OUT/compare.txt
cp kernels/fp8_gemm_tables/nvidia_h200.json $OUT/nvidia_h200.json
timeout 300 python3 benchmarks/tune_fp8_gemm.py --configs dsv32-bench-16l glm5-bench dsv32-rank-ep16 dsv32-rank-ep8 glm5-rank-ep8 \
  --parallel 1x1 --max-tokens 256 --shapes 4096:7168 7168:2048 4096:6144 6144:2048 2048:6144 2048:7168 \
  --out $OUT/nvidia_h200.json > $OUT/tune.log 2>&1
grep "^grouped\|^dense\|wrote\|Error" $OUT/tune.log | tail -90
