#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# The GPU `rest` stage (engine, model, parallel tests on one GPU) at the structured-outputs tree.
set -uo pipefail
export TRITON_CACHE_DIR=/tmp/triton
OUT=$OUT/res TESTS_TIMEOUT=240 bash benchmarks/gpu_suite.sh rest
