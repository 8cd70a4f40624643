#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried); callF wrote the GPU-suite folder's fp8 log.
# FP8 prefill end to end on one rank of DeepSeek-V3.2 (dsv32-rank-ep8, dense mode, 8K prompt): the GPU table with
# the scaled_mm rule vs Triton only vs everything measured at warm-up vs bf16 weights; then the `rest` GPU stage.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L; git log -1 --format=%h 2>/dev/null
R=$OUT/res; mkdir -p $R
run() {  # name, env..., then args
  local name=$1; shift
  local t0=$(date +%s)
  env "$@" timeout 110 python3 benchmarks/bench_prefill.py --config dsv32-rank-ep8 --modes dense --prompt-lens 8192 \
    --repeats 2 --warmup 1 --out $R/prefill_$name.json $Q >$R/prefill_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 )) s"; tail -4 $R/prefill_$name.log
}
Q="--quantization fp8"; run table X=1
Q="--quantization fp8"; run triton HISPARSE_FP8_GEMM=triton
Q="--quantization fp8"; run measure HISPARSE_FP8_GEMM_TUNING=measure
Q=""; run bf16 X=1
OUT=$R TESTS_TIMEOUT=230 bash benchmarks/gpu_suite.sh rest
tar czf $OUT/res.tgz -C $OUT res
