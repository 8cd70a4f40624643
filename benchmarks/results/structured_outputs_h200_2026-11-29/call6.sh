#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Structured outputs with the batched (multithreaded) bitmask fill: the per-step cost table again, then the whole
# GPU `hisparse` stage at this tree (it includes the structured-output and logits-processing GPU tests).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
nvidia-smi -L
timeout 120 python3 benchmarks/bench_logits_processing.py --batch-sizes 1 16 64 128 --grammar --json $OUT/res/bench_logits_processing.json 2>&1 | grep -v "ready in" | tail -12
OUT=$OUT/res TESTS_TIMEOUT=430 bash benchmarks/gpu_suite.sh hisparse
