#!/usr/bin/env bash
# Session 19 (2026-11-27): the GPU suite (SUITE_PATHS, default all) at this tree; tests/api and tests/disagg need
# wheels this call does not ship (schemathesis, mooncake), as in the earlier suite calls. A test that stalls fails
# after TEST_TIMEOUT s with its stack (pytest-timeout) instead of using up the call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout ${SUITE_S:-555} python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs --durations=10 --timeout ${TEST_TIMEOUT:-240} --ignore=tests/api --ignore=tests/disagg ${SUITE_PATHS:-tests} > $OUT/${G}_gpu_suite.log 2>&1
echo "suite rc $?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/${G}_gpu_suite.log | tail -8
