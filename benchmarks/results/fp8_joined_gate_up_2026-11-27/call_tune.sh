#!/usr/bin/env bash
# Session 16 (2026-11-27), stage t, as run on the H200 and then the H100: tune the routed experts' joined gate+up shapes (N 2I : K H) into a copy of
# this GPU's shipped table at M <= 256 for every layout the table coverage test holds tables to, then bench_fp8_gemm
# at M 1 / 16 / 64 (its joined row and the MoE layer apart / joined).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/bench_tmp/new
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cd bench_tmp/new
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
start=$SECONDS
for job in "dsv32-bench-16l:1x1:4096:7168" "deepseek-v3.2:1x1 8x8:4096:7168" "dsv32-rank-ep16 dsv32-rank-ep8:1x1:4096:7168" "glm-5:1x1 8x8:4096:6144" "glm5-rank-ep8 glm5-bench:1x1:4096:6144"; do
  IFS=: read -r names layouts n k <<<"$job"
  left=$(( ${BUDGET:-470} - (SECONDS - start) )); [ $left -lt 40 ] && { echo "skip $names: ${left} s left"; continue; }
  s=$SECONDS
  timeout $left python3 benchmarks/tune_fp8_gemm.py --configs $names --parallel $layouts --max-tokens 256 --shapes $n:$k --out $OUT/${G}_table.json >> $OUT/${G}_tune.log 2>&1
  echo "tune $names ($layouts) rc $? in $((SECONDS-s)) s"; tail -1 $OUT/${G}_tune.log
done
grep -E "grouped N= *4096" $OUT/${G}_tune.log | grep -E "M≤ *(1|16|64|256):" | tail -12
left=$(( 580 - SECONDS )); s=$SECONDS
[ $left -gt 40 ] && { timeout $left python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1; echo "gemm rc $? in $((SECONDS-s)) s"; tail -7 $OUT/${G}_gemm.log; }
