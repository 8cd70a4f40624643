#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Logits processing at the final tree: per-step micro cost, the decode step of one DeepSeek-V3.2 EP8 rank (32K,
# graphs + overlap) greedy against every request penalized, and the GPU tests (reference, HiSparse == dense, syncs).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
nvidia-smi -L
timeout 90 python3 benchmarks/bench_logits_processing.py --batch-sizes 1 16 64 128 --json $OUT/res/bench_logits_processing.json 2>&1 | tail -6
ARGS="--config dsv32-rank-ep8 --contexts 32768 --miss-rates 0.05 --batch-sizes 1 --max-batch 16 --skip-model-indexer-run --steps 30 --warmup 3 --host-memory-fraction 0.7"
for s in greedy penalized; do
  timeout 130 python3 benchmarks/bench_decode.py $ARGS --sampling $s --out $OUT/res/step_$s.json > $OUT/res/step_$s.log 2>&1
  echo "$s rc $?"
  grep -E "^(dense|hisparse)" $OUT/res/step_$s.log | tail -6
done
timeout 200 python3 -m pytest -m gpu tests/hisparse/test_logits_processing.py -p no:cacheprovider -o addopts="" -q -rfEs --durations=4 > $OUT/res/gpu_tests.log 2>&1
echo "tests exit $?"
grep -E "^(FAILED|ERROR)|^E  | passed| failed|^[0-9.]+s " $OUT/res/gpu_tests.log | tail -12
