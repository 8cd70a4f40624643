#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (prefill_fp8.py is in this folder).
# Untabled dense FP8 keys at prefill sizes take scaled_mm by rule: the FP8 GEMM at prefill sizes (forced Triton,
# as before, against the rule), then the FP8 model and FP8-weights HiSparse == dense GPU tests under the rule.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
timeout 60 python3 bench_tmp/prefill_fp8.py 2>&1 | grep -v "Warning\|warn" | tee $OUT/prefill_fp8.txt
timeout 200 python3 -m pytest -m gpu tests/model/test_fp8_model_gpu.py tests/hisparse/test_fp8_weights_lossless_gpu.py \
  -p no:cacheprovider -o addopts="" -q -s -rfEs 2>&1 | grep -v "it/s\]" > $OUT/fp8_tests.log
grep "FP8-MODEL\|passed\|failed\|FAILED\|Error" $OUT/fp8_tests.log | tail -12
