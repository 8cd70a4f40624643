#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried); callF wrote the GPU-suite folder's fp8 log.
# The H200 FP8 GEMM table at prefill chunks' sizes (token counts 512-2048: dense, batched and grouped keys), merged
# into a copy of the shipped table under $OUT; then the `hisparse` GPU stage.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
cp kernels/fp8_gemm_tables/nvidia_h200.json $R/nvidia_h200.json
tune() {  # layout, configs...
  local layout=$1; shift
  local t0=$(date +%s)
  timeout 70 python3 benchmarks/tune_fp8_gemm.py --configs "$@" --parallel $layout --min-tokens 512 --max-tokens 2048 \
    --out $R/nvidia_h200.json >>$R/tune.log 2>&1
  echo "tune $layout $* rc=$? $(( $(date +%s) - t0 )) s"
}
tune 1x1 dsv32-rank-ep8
tune 1x1 glm5-rank-ep8
tune 1x1 dsv32-rank-ep16 dsv32-bench
tune 1x1 dsv32-bench-16l glm5-bench
tune 8x8 deepseek-v3.2 glm-5
grep -c '"kind"' $R/nvidia_h200.json
OUT=$R TESTS_TIMEOUT=330 bash benchmarks/gpu_suite.sh hisparse
tar czf $OUT/res.tgz -C $OUT res
