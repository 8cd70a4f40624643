#!/usr/bin/env bash
# H200: the engine-side call (tests, FlashMLA compare, Gluon sweep), then the HiSparse GPU stage with the Gluon kernel.
export T_TESTS=200
bash benchmarks/results/sparse_mla_gluon_engine_2026-11-28/call.sh
TESTS_TIMEOUT=${HS_TIMEOUT:-380} bash benchmarks/gpu_suite.sh hisparse
