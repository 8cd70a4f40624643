#!/usr/bin/env bash
# The side copy's "auto" cap: GPU tests, then glm5-shared-bench (FP8 / bf16 rows) and glm5-rank-ep8 with 8 / 16 / auto.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs \
  tests/kernels/test_kernels_gpu.py -k "bound_swap_in" > $OUT/gpu_tests_kernels.log 2>&1
echo "kernel tests rc=$?"; tail -2 $OUT/gpu_tests_kernels.log
timeout 240 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs tests/hisparse/test_prefetch_shared_gpu.py \
  tests/hisparse/test_speculative_prefetch_gpu.py tests/hisparse/test_early_swap_in_gpu.py > $OUT/gpu_tests_side.log 2>&1
echo "side-stream tests rc=$?"; tail -2 $OUT/gpu_tests_side.log
B="--contexts 32768 --modes hisparse --skip-model-indexer-run --hisparse-prefetch-shared-layers on"
timeout 150 python3 benchmarks/bench_decode.py --config glm5-shared-bench $B --miss-rates --batch-sizes 64 96 128 \
  --batch-miss-rates 0 0.2 --steps 30 --kv-cache-dtype fp8_e4m3 --hisparse-side-copy-blocks 8 16 auto \
  --out $OUT/bench_fp8.json > $OUT/bench_fp8.log 2>&1; echo "bench fp8 rc=$?"
timeout 100 python3 benchmarks/bench_decode.py --config glm5-shared-bench $B --miss-rates --batch-sizes 64 128 \
  --batch-miss-rates 0 0.2 --steps 30 --kv-cache-dtype bfloat16 --hisparse-side-copy-blocks 8 16 auto \
  --out $OUT/bench_bf16.json > $OUT/bench_bf16.log 2>&1; echo "bench bf16 rc=$?"
timeout 240 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 $B --miss-rates 0 0.2 --batch-sizes \
  --steps 10 --warmup 2 --host-memory-fraction 0.7 --hisparse-side-copy-blocks 16 auto \
  --out $OUT/rank.json 2>&1 | grep -v "it/s\]" > $OUT/rank.log; echo "rank rc=${PIPESTATUS[0]}"
python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "gpu-out")
for f in ("bench_fp8", "bench_bf16", "rank"):
    try:
        rs = json.load(open(f"{out}/{f}.json"))["results"]
    except Exception as e:
        print(f, "missing", e); continue
    for r in rs:
        print(f"{f:<11}{r['mode']:<26}{r.get('batch', 0):>5}{r.get('step_ms') or 0:>9.2f} {r.get('error', '')[:80]}")
PY
