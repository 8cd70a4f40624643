#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried); callF wrote the GPU-suite folder's fp8 log.
# FP8 prefill end to end on dsv32-rank-ep8 (dense, 8K and 32K prompts): the new H200 table (prefill buckets measured)
# vs the table before it (prefill dense keys by the scaled_mm rule, grouped at the untimed default) vs Triton only;
# then the `kernels` GPU stage with the new table.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
T=kernels/fp8_gemm_tables/nvidia_h200.json
cp $T /tmp/new.json
run() {  # name, prompt lengths, env...
  local name=$1 lens=$2; shift 2
  local t0=$(date +%s)
  env "$@" timeout 150 python3 benchmarks/bench_prefill.py --config dsv32-rank-ep8 --modes dense --prompt-lens $lens \
    --repeats 2 --warmup 1 --out $R/prefill_$name.json --quantization fp8 >$R/prefill_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; grep -E "^dense|untimed" $R/prefill_$name.log | cut -c1-200
}
run warm 8192 X=1              # first process: builds the CUDA extensions and Triton caches, not compared
run new "8192 32768" X=1
cp bench_tmp/h200_old.json $T; run old "8192 32768" X=1
cp /tmp/new.json $T; run triton "8192 32768" HISPARSE_FP8_GEMM=triton
OUT=$R TESTS_TIMEOUT=280 bash benchmarks/gpu_suite.sh kernels
tar czf $OUT/res.tgz -C $OUT res
