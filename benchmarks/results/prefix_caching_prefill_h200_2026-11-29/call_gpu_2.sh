#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Prefix caching: the GPU `rest` stage (engine, model, parallel tests on one GPU).
set -uo pipefail
export TRITON_CACHE_DIR=/tmp/triton
OUT=$OUT/res TESTS_TIMEOUT=570 bash benchmarks/gpu_suite.sh rest
