#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried); callF wrote the GPU-suite folder's fp8 log.
# Why the GPU-table FP8 prefill of dsv32-rank-ep8 (8K) ran past 110 s while Triton-only took 28 s: tracebacks
# every 15 s, then smaller models in table / scaled_mm / triton modes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
run() {  # name, limit, config, env...
  local name=$1 lim=$2 cfg=$3; shift 3
  local t0=$(date +%s)
  env "$@" timeout $lim python3 bench_tmp/tb_wrap.py 15 --config $cfg --modes dense --prompt-lens 8192 \
    --repeats 2 --warmup 1 --out $R/prefill_$name.json --quantization fp8 >$R/prefill_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^dense" $R/prefill_$name.log
}
run bench_table 100 dsv32-bench X=1
run bench_triton 100 dsv32-bench HISPARSE_FP8_GEMM=triton
run bench_scaled 100 dsv32-bench HISPARSE_FP8_GEMM=scaled_mm
run rank_table 130 dsv32-rank-ep8 X=1
nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
tar czf $OUT/res.tgz -C $OUT res
