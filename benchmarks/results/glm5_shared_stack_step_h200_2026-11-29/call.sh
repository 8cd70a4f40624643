#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried; the table it wrote is the shipped one).
# Issue 23 / FP8 tables, H200: (1) the shared layers' q_b alone (N 16384, K 2048) at prefill sizes into the H200 table;
# (2) glm5-rank-ep8's decode step at a fixed batch with the stacked q_a + kv_a (N 2624, the table as shipped) and
# without it (the same table less its 13 N 2624 entries, so worth_stacking says no), A B A B, 0 % and 20 % misses.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
R=$OUT/res; mkdir -p $R
nvidia-smi -L
T=kernels/fp8_gemm_tables/nvidia_h200.json
t0=$(date +%s)
timeout 150 python3 benchmarks/tune_fp8_gemm.py --configs glm5-rank-ep8 --parallel 1x1 --min-tokens 512 --max-tokens 4096 \
  --shapes 16384:2048 > $R/tune_qb.log 2>&1
echo "tune rc=$? $(( $(date +%s) - t0 )) s"; tail -4 $R/tune_qb.log; cp $T $R/nvidia_h200.json
python3 - <<'PY'
import json
t = json.load(open("kernels/fp8_gemm_tables/nvidia_h200.json"))
entries = [e for e in t["entries"] if e["n"] != 2624]
print("entries", len(t["entries"]), "without N 2624:", len(entries))
t["entries"] = entries
json.dump(t, open("/tmp/nostack.json", "w"), indent=1)
PY
RANK="--config glm5-rank-ep8 --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --max-batch 44 --steps 20 --warmup 3 --host-memory-fraction 0.7"
run() {  # name, env...
  local name=$1; shift
  local t1=$(date +%s)
  env "$@" timeout 200 python3 benchmarks/bench_decode.py $RANK --out $R/rank_$name.json > $R/rank_$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s) - t1 )) s"; grep -E "^hisparse|untimed|stack" $R/rank_$name.log | cut -c1-170
}
run stack1 X=1
run nostack1 HISPARSE_FP8_GEMM_TABLE=/tmp/nostack.json
run stack2 X=1
run nostack2 HISPARSE_FP8_GEMM_TABLE=/tmp/nostack.json
tar czf $OUT/res.tgz -C $OUT res
