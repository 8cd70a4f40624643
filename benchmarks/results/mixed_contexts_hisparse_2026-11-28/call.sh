#!/usr/bin/env bash
# For the next GPU session (issue 23, per-request cost): HiSparse's step with mixed contexts (each request's context
# uniform in [L/8, L], its synthetic window over its own context: bench_decode.py --mixed-contexts --miss-rates, new
# on 2026-11-28 and not yet run on a GPU), against equal contexts, with the balanced and the per-query scores
# kernels, on one EP8 rank of DeepSeek-V3.2 at 32K. One H200 call, ~7 minutes.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
ARGS="--config dsv32-rank-ep8 --contexts 32768 --modes dense hisparse --skip-model-indexer-run --miss-rates 0.05 0.2
  --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 --indexer-split both"
for kind in mixed equal; do
  extra=$([[ $kind == mixed ]] && echo --mixed-contexts)
  timeout 270 python3 benchmarks/bench_decode.py $ARGS $extra --out $OUT/rank_$kind.json 2>&1 \
    | grep -v "it/s\]" > $OUT/rank_$kind.log
  echo "$kind rc=${PIPESTATUS[0]}"
  grep "^dense\|^hisparse\|^mode" $OUT/rank_$kind.log
done
