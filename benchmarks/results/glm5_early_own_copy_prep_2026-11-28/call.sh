#!/usr/bin/env bash
# For a GPU session (H200: GLM-5's rank needs its memory; ~6 minutes, one call, run on the UNPATCHED tree):
# glm5-rank-ep8 at 32K, 0 % and 20 % misses, prefetch on: the early swap-in off (the default) against on, where on
# the full layers' own swap-ins take their own copy cap (`early_own_copy.patch`, env HISPARSE_EXP_EARLY_OWN_COPY_BLOCKS):
# the same cap as the followers ("auto"), 32 blocks, and the full grid (0).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
D=benchmarks/results/glm5_early_own_copy_prep_2026-11-28
git apply $D/early_own_copy.patch || exit 2
run() {  # name, early flag, then the env assignment (or nothing)
  local name=$1 early=$2; shift 2
  env "$@" timeout 170 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
    --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --hisparse-prefetch-shared-layers on --hisparse-early-swap-in $early --out $OUT/r/$name.json 2>&1 \
    | grep -v "it/s\]" > $OUT/r/$name.log
  echo "== $name"; grep "^hisparse\|^mode" $OUT/r/$name.log
  tar czf $OUT/results.tgz -C $OUT r
}
run early_both_own_auto both HISPARSE_EXP_EARLY_OWN_COPY_BLOCKS=auto   # off (the default) and on, every cap "auto"
run early_own_32 on HISPARSE_EXP_EARLY_OWN_COPY_BLOCKS=32
run early_own_0 on HISPARSE_EXP_EARLY_OWN_COPY_BLOCKS=0
