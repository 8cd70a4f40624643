#!/usr/bin/env bash
# Session 18 (2026-11-27): re-tune every grouped FP8 GEMM key of both tables with the tuner's new routing samples
# (kernels/fp8_gemm.py grouped_routing_samples: the bucket's two ends, rows on distinct experts) into a copy of
# this GPU's shipped table at M <= 256: the layouts the table coverage test holds tables to, bench configs first.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
start=$SECONDS
for job in "dsv32-bench-16l|1x1|4096:7168 7168:2048" "glm5-bench|1x1|4096:6144 6144:2048 2048:6144" \
           "dsv32-rank-ep16 dsv32-rank-ep8|1x1|4096:7168 7168:2048 2048:7168" "glm5-rank-ep8|1x1|4096:6144 6144:2048" \
           "deepseek-v3.2|8x8|2048:7168 7168:2048" "glm-5|8x8|2048:6144 6144:2048" \
           "deepseek-v3.2|1x1|4096:7168 7168:2048" "glm-5|1x1|4096:6144 6144:2048"; do
  IFS='|' read -r names layouts shapes <<<"$job"
  left=$(( ${BUDGET:-300} - (SECONDS - start) )); [ $left -lt 40 ] && { echo "skip $names $layouts: ${left} s left"; continue; }
  s=$SECONDS
  timeout $left python3 benchmarks/tune_fp8_gemm.py --configs $names --parallel $layouts --max-tokens 256 --shapes $shapes --out $OUT/${G}_table.json >> $OUT/${G}_tune.log 2>&1
  echo "tune $names ($layouts) rc $? in $((SECONDS-s)) s"; tail -1 $OUT/${G}_tune.log
done
grep -E "grouped N= *(4096|7168) .*E= *(8|9) .*M≤ *(1|2|4|8|16):" $OUT/${G}_tune.log | tail -24
