#!/usr/bin/env bash
# For a GPU session (H200, ~5 minutes, the tree as it is): issue 23 item 3 at glm5-rank-ep8's 64K and 128K with the
# grouped GEMM of 0d10512 (1.12× / 1.09× were measured before it; 32K went from 1.14× to 1.16×).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
for ctx in 65536 131072; do
  timeout 250 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts $ctx --modes hisparse \
    --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --hisparse-prefetch-shared-layers on --out $OUT/r/glm5_item3_$ctx.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_item3_$ctx.log
  echo "== $ctx"; grep "^hisparse\|^mode" $OUT/r/glm5_item3_$ctx.log
  tar czf $OUT/results.tgz -C $OUT r
done
