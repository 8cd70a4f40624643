#!/usr/bin/env bash
# Stage b (2026-11-27, session 15), as run: re-tune the shipped table's real configurations at decode's buckets
# (M <= 64) with the new tuner, starting from stage a's table (bench_tmp/new/kernels/fp8_gemm_tables/ holds it).
set -uo pipefail
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/bench_tmp/new
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cd bench_tmp/new
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
start=$SECONDS
for job in "deepseek-v3.2:1x1 8x8" "glm-5:1x1 8x8" "glm5-bench dsv32-rank-ep16:1x1"; do
  left=$(( ${BUDGET:-500} - (SECONDS - start) )); [ $left -lt 60 ] && { echo "skip $job: ${left} s left"; continue; }
  s=$SECONDS; name=${job%%:*}
  timeout $left python3 benchmarks/tune_fp8_gemm.py --configs $name --parallel ${job#*:} --max-tokens 64 --out $OUT/${G}_table.json >> $OUT/${G}_tune_real.log 2>&1
  echo "tune $job rc $? in $((SECONDS-s)) s"; tail -1 $OUT/${G}_tune_real.log
done
