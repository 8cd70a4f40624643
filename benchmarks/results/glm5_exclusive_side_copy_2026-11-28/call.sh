#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (the tree had exclusive_side_copy.patch applied).
# GLM-5's rank at 32K: the side copy's blocks alone on their SMs (exclusive_side_copy.patch: a capped copy block
# asks for a whole SM's shared memory when HISPARSE_EXCLUSIVE_SIDE_COPY=1) against the tree's (main-stream blocks
# share the copy's SMs). One build, two processes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
run() {  # tag, env value, caps...
  local tag=$1 env=$2; shift 2
  HISPARSE_EXCLUSIVE_SIDE_COPY=$env timeout 270 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 \
    --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
    --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --hisparse-side-copy-blocks "$@" \
    --out $OUT/glm5_$tag.json 2>&1 | grep -v "it/s\]" > $OUT/glm5_$tag.log
  echo "$tag rc=${PIPESTATUS[0]}"
  grep "^hisparse\|^mode" $OUT/glm5_$tag.log
}
run shared 0 auto
run exclusive 1 auto 16
so=$(find /tmp/kc -name "*.so" | head -3); echo "$so"
for f in $so; do cuobjdump -res-usage "$f" 2>/dev/null | grep -A1 "swap_in_copy\|swap_in_plan" | grep -o "Function [^:]*\|REG:[0-9]*\|SHARED:[0-9]*" | paste - - - | head -8; done
