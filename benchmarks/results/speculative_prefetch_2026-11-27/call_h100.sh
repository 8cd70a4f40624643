#!/usr/bin/env bash
# H100: the speculative prefetch's GPU tests, the rank (ep16) matrix and dsv32-bench at batch 64.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
timeout 170 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs tests/hisparse/test_speculative_prefetch_gpu.py \
  > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -3 $OUT/gpu_tests.log
fi
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if (( mem_mib > 100000 )); then CONFIG=dsv32-rank-ep8; else CONFIG=dsv32-rank-ep16; fi
timeout ${RANK_LIMIT:-300} python3 benchmarks/bench_decode.py --config $CONFIG --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
  --cross-layer-overlap 0 0.5 0.8 1.0 --hisparse-speculative-prefetch both --out $OUT/rank_spec.json \
  2>&1 | grep -v "it/s\]" > $OUT/rank_spec.log
echo "rank rc=${PIPESTATUS[0]}"
timeout ${BENCH_LIMIT:-150} python3 benchmarks/bench_decode.py --config dsv32-bench --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates --batch-sizes 64 --batch-miss-rates 0 0.2 --steps 20 --warmup 3 \
  --cross-layer-overlap 0 0.8 --hisparse-speculative-prefetch both --out $OUT/bench_spec.json \
  2>&1 | grep -v "it/s\]" > $OUT/bench_spec.log
echo "bench rc=${PIPESTATUS[0]}"
python3 - <<'PY'
import json, os
for f in ("rank_spec", "bench_spec"):
    try:
        rs = json.load(open(os.environ.get("OUT", "gpu-out") + f"/{f}.json"))["results"]
    except Exception as e:
        print(f, "missing", e); continue
    print(f"{f}: {'mode':<28}{'batch':>6}{'step ms':>9}{'hit':>7}{'H2D MB':>9}{'bet rows':>10}")
    for r in rs:
        if "error" in r:
            print(r["mode"], "ERROR", r["error"][:100]); continue
        print(f"{'':<{len(f)+2}}{r['mode']:<28}{r['batch']:>6}{r['step_ms']:>9.2f}{r['hit_rate'] or 0:>7.3f}{r['h2d_bytes_per_step']/1e6:>9.1f}{r['speculative_rows_per_step']:>10.0f}")
PY
