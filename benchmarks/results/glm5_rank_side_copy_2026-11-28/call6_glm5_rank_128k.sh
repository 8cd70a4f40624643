#!/usr/bin/env bash
# glm5-rank-ep8 at 32K: dense, and HiSparse at 0 / 5 / 20 % synthetic misses with the shared-layer prefetch off and on
# (issue 23 item 3 at the rank shape; GLM-5's rank config was never run as a step before).
# (the header above was copied from call 1 with this script: this run is the context in its name, prefetch on only, the default "auto" cap)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L; free -g | head -2
timeout ${RANK_LIMIT:-330} python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 131072 \
  --modes dense hisparse --skip-model-indexer-run --miss-rates 0 0.05 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on ${EXTRA:-} --out $OUT/glm5_rank_128k.json \
  2>&1 | grep -v "it/s\]" > $OUT/glm5_rank_128k.log
echo "rank rc=${PIPESTATUS[0]}"
grep -v "^              " $OUT/glm5_rank_128k.log | tail -30
