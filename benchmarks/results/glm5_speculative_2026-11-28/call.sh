#!/usr/bin/env bash
# For a GPU session (H200: GLM-5's rank needs its memory; ~5 minutes, one call, the tree as it is): issue 23 item 3 at
# glm5-rank-ep8, 32K. The speculative prefetch (`hisparse.speculative_prefetch`) bets each full layer's top-k on the
# next full layer's buffer, three shared layers ahead in GLM-5, so the full layers' own misses (5.75 ms of the 20 %
# step, the design floor of the prefetch of shared layers alone: 1.12x) could load beside the followers. Bets off and on,
# 0 % and 20 % misses, the synthetic selections' cross-layer share C 0 / 0.5 / 0.8.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
timeout 540 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
  --hisparse-prefetch-shared-layers on --hisparse-speculative-prefetch both --cross-layer-overlap 0 0.5 0.8 \
  --out $OUT/r/glm5_spec_32k.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_spec_32k.log
grep "^hisparse\|^mode" $OUT/r/glm5_spec_32k.log
tar czf $OUT/results.tgz -C $OUT r
