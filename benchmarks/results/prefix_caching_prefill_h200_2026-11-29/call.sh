#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Prefix caching: time to first token of a 32K prompt on one DeepSeek-V3.2 EP8 rank (FP8 weights and rows), uncached
# against half and 30K of 32K cached, dense and HiSparse, in one process.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
nvidia-smi -L
timeout 570 python3 benchmarks/bench_prefill.py --config dsv32-rank-ep8 --quantization fp8 --kv-cache-dtype fp8_e4m3 \
  --modes dense hisparse --prompt-lens 32768 --repeats 2 --warmup 1 --cached-prefix-fractions 0.5 0.9375 \
  --device-kv-budget-gib 8 --host-kv-budget-gib 8 --out $OUT/res/bench_prefill_cached.json 2>&1 | tee $OUT/res/log.txt | tail -12
