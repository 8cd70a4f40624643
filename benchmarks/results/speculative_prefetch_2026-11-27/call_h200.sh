#!/usr/bin/env bash
# Speculative prefetch: GPU tests, then the rank at 32K with 20 % synthetic misses at cross-layer overlaps, bets off/on.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L; git log --oneline -1 2>/dev/null
timeout 170 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs tests/hisparse/test_speculative_prefetch_gpu.py \
  "tests/hisparse/test_prefetch_shared_gpu.py::test_prefetch_is_bit_identical_on_cuda" tests/hisparse/test_early_swap_in_gpu.py \
  > $OUT/gpu_tests.log 2>&1
echo "tests rc=$?"; tail -5 $OUT/gpu_tests.log
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if (( mem_mib > 100000 )); then CONFIG=dsv32-rank-ep8; else CONFIG=dsv32-rank-ep16; fi
timeout ${RANK_LIMIT:-330} python3 benchmarks/bench_decode.py --config $CONFIG --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
  --cross-layer-overlap 0 0.5 0.8 1.0 --hisparse-speculative-prefetch both --out $OUT/rank_spec.json \
  2>&1 | grep -v "it/s\]" > $OUT/rank_spec.log
echo "rank rc=${PIPESTATUS[0]}"
python3 - <<'PY'
import json, os
rs = json.load(open(os.environ.get("OUT", "gpu-out") + "/rank_spec.json"))["results"]
print(f"{'mode':<28}{'batch':>6}{'step ms':>9}{'hit':>7}{'H2D MB':>9}{'bet rows':>10}")
for r in rs:
    if "error" in r:
        print(r["mode"], "ERROR", r["error"][:100]); continue
    print(f"{r['mode']:<28}{r['batch']:>6}{r['step_ms']:>9.2f}{r['hit_rate'] or 0:>7.3f}{r['h2d_bytes_per_step']/1e6:>9.1f}{r['speculative_rows_per_step']:>10.0f}")
PY
