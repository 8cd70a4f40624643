#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (2026-11-28, the tree of af2cfe9).
# Issue 23 item 3: the bets' payoff counterfactual (rows_saved_by_bets) on CUDA (GPU test) and at glm5-rank-ep8, 32K.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
git log --oneline -1 2>/dev/null
timeout 150 python3 -m pytest -m gpu tests/hisparse/test_speculative_prefetch_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs \
  > $OUT/r/gpu_tests_speculative.log 2>&1
tail -3 $OUT/r/gpu_tests_speculative.log
timeout 420 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
  --hisparse-prefetch-shared-layers on --hisparse-speculative-prefetch both --cross-layer-overlap 0 0.5 0.8 1.0 \
  --out $OUT/r/glm5_spec_payoff_32k.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_spec_payoff_32k.log
grep "^hisparse\|^mode\|bets:" $OUT/r/glm5_spec_payoff_32k.log
tar czf $OUT/results.tgz -C $OUT r
