# ruff: noqa  -- kept as it ran on the device, 2026-11-28 (commit 21069fd); run 2 the same, run 3 without --mixed-contexts
#!/usr/bin/env bash
# The decode step with mixed contexts on one DeepSeek-V3.2 EP 8 rank (61 layers, FP8), dense (the model's own
# indexer selection), the indexer's scores by the balanced split (the default) and by the per-query kernel.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ARGS="--config dsv32-rank-ep8 --mixed-contexts --miss-rates --batch-sizes --modes dense --indexer-split both --steps 30 --warmup 3 --host-memory-fraction 0.7"
timeout 400 python3 benchmarks/bench_decode.py $ARGS --contexts 32768 8192 --out $OUT/step_mixed.json > $OUT/step_mixed.log 2>&1
echo "rc $?"
grep -E "done: |skipped|Error" $OUT/step_mixed.log | tail -12
python3 - <<'PY'
import json, os
for r in json.load(open(os.environ["OUT"] + "/step_mixed.json"))["results"]:
    print(r["mode"], r["context"], r.get("mean_context"), r.get("batch"), round(r.get("step_ms", 0), 3), r.get("indexer_scores"), r.get("error", ""))
PY
