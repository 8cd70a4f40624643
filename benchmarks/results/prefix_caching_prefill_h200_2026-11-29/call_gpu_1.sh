#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Prefix caching: the GPU hisparse stage (includes tests/hisparse/test_prefix_caching.py's gpu tests).
set -uo pipefail
export TRITON_CACHE_DIR=/tmp/triton
OUT=$OUT/res TESTS_TIMEOUT=570 bash benchmarks/gpu_suite.sh hisparse
grep -E "prefix_caching|passed|failed" $OUT/res/gpu_tests_hisparse.log | tail -8
