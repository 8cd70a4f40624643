#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried).
# FP8 prefill of one GLM-5 rank (glm5-rank-ep8, dense, 8K prompt): the H200 table measured at prefill sizes (as
# committed) against e0905fc's table, two processes in one call (the first also builds the kernels' caches; each
# process prefills once untimed before its two timed prefills).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
T=kernels/fp8_gemm_tables/nvidia_h200.json
run() {  # name, limit
  local name=$1 lim=$2
  local t0=$(date +%s)
  timeout $lim python3 benchmarks/bench_prefill.py --config glm5-rank-ep8 --modes dense --prompt-lens 8192 \
    --repeats 2 --warmup 1 --out $R/glm5_prefill_$name.json --quantization fp8 >$R/glm5_prefill_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^dense|untimed" $R/glm5_prefill_$name.log | cut -c1-220
}
run new 150
cp bench_tmp/h200_old.json $T; run old 90
