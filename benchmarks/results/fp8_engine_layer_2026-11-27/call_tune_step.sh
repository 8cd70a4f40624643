#!/usr/bin/env bash
# Session 18 (2026-11-27): re-tune every grouped FP8 GEMM key of this GPU's table with the tuner's decode routing
# samples (kernels/fp8_gemm.py grouped_routing_samples: each token's distinct experts + the fused shared expert's
# row, the bucket's fewest and most tokens), install the table, then the decode step FP8 vs bf16 for the old tree
# (690add6: one uniform random draw per key) and the new one, each step's read rate, and GPU tests if time is left.
set -uo pipefail
ROOT=$PWD
bash bench_tmp/call_tune.sh
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cp $OUT/${G}_table.json $ROOT/kernels/fp8_gemm_tables/$SLUG.json
bash bench_tmp/call_step.sh
