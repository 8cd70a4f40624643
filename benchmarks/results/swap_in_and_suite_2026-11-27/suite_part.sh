#!/usr/bin/env bash
# One part of the whole GPU suite (PART=a: tests/hisparse tests/deploy; PART=b: the rest), plus an extra command.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr ' ' '_')
if [[ $PART == a ]]; then paths="tests/hisparse tests/deploy"; else paths="tests/kernels tests/model tests/parallel tests/engine tests/test_dense_backend.py"; fi
timeout ${SUITE_LIMIT:-540} python3 -m pytest -m gpu $paths -p no:cacheprovider -o addopts="" -q -rfEs --durations=8 \
  > $OUT/suite_${PART}_$gpu.log 2>&1
echo "suite $PART rc=$?"; grep -E "passed|failed" $OUT/suite_${PART}_$gpu.log | tail -3; grep -E "^FAILED|^ERROR" $OUT/suite_${PART}_$gpu.log | head
if [[ -n ${EXTRA:-} ]]; then eval "$EXTRA"; fi
