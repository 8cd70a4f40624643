#!/usr/bin/env bash
# Stage c (2026-11-27, session 15), as run: the decode step with the table to ship (stage b's, in the new tree) and
# bench_fp8_gemm's per-projection read rates at M 1 / 16 / 64 (its own measure-mode tuning: the new tuner).
set -uo pipefail
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/bench_tmp/new
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
cd bench_tmp/new
s=$SECONDS
timeout ${STEP_TIMEOUT:-110} python3 benchmarks/bench_fp8_step.py --batches 1 16 64 --steps 20 --out $OUT/${G}_step_final.json > $OUT/${G}_step_final.log 2>&1
echo "step final rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_step_final.log | head -4
s=$SECONDS
timeout ${GEMM_TIMEOUT:-150} python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1
echo "gemm rc $? in $((SECONDS-s)) s"; tail -5 $OUT/${G}_gemm.log
