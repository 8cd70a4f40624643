#!/usr/bin/env bash
# H100: FP8 dequantization beside the PV or not (timing), the engine-side call without the sweep, the HiSparse stage.
bash bench_tmp/call_overlap.sh
SKIP_SWEEP=1 T_TESTS=150 bash benchmarks/results/sparse_mla_gluon_engine_2026-11-28/call.sh
TESTS_TIMEOUT=330 bash benchmarks/gpu_suite.sh hisparse
