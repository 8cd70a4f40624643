#!/usr/bin/env bash
# Session 17 (2026-11-27): tune the new shapes into a copy of this GPU's shipped table at M <= 256: the stacked query
# projections (q_b + the indexer's wq_b: N q_b+wq_b : K q_lora) and the fused shared expert's E+1 grouped shapes
# ([gate ; up] 2I : H and down H : I) for every layout the table coverage test holds tables to.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
start=$SECONDS
for job in "dsv32-bench-16l|1x1|32768:1536 4096:7168 7168:2048" "deepseek-v3.2|8x8|11264:1536" \
           "dsv32-rank-ep16 dsv32-rank-ep8|1x1|32768:1536 4096:7168 7168:2048" \
           "glm5-rank-ep8 glm5-bench|1x1|20480:2048 4096:6144 6144:2048" \
           "deepseek-v3.2|1x1|32768:1536 4096:7168 7168:2048" "glm-5|1x1|20480:2048 4096:6144 6144:2048"; do
  IFS='|' read -r names layouts shapes <<<"$job"
  left=$(( ${BUDGET:-560} - (SECONDS - start) )); [ $left -lt 40 ] && { echo "skip $names $layouts: ${left} s left"; continue; }
  s=$SECONDS
  timeout $left python3 benchmarks/tune_fp8_gemm.py --configs $names --parallel $layouts --max-tokens 256 --shapes $shapes --out $OUT/${G}_table.json >> $OUT/${G}_tune.log 2>&1
  echo "tune $names ($layouts) rc $? in $((SECONDS-s)) s"; tail -1 $OUT/${G}_tune.log
done
grep -E "(dense N= *(32768|11264|20480)|grouped N= *(4096|7168|6144) .*E= *(9|17|33|257)) .*M≤ *(1|16|64):" $OUT/${G}_tune.log | tail -24
