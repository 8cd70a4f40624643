#!/usr/bin/env bash
# For the next GPU session (issue 23 item 3): the capped side-stream copy in 2-warp blocks (small_capped_blocks.patch)
# against main's 8-warp blocks, same call: the bound swap-in GPU tests on the patched tree, then glm5-shared-bench
# (prefetch on, 32K, 0 % / 20 % misses, FP8 and bf16 rows) on both trees, and bench_swap_in's copy caps alone.
# The patched tree is made here before the call (the device copy has no .git), e.g.:
#   rm -rf bench_tmp && mkdir -p bench_tmp/new && git archive HEAD | tar -x -C bench_tmp/new \
#     && rm -rf bench_tmp/new/benchmarks/results bench_tmp/new/docs \
#     && (cd bench_tmp/new && patch -p1 < ../../benchmarks/results/side_copy_small_blocks_2026-11-27/small_capped_blocks.patch)
# (move bench_tmp out of the tree before committing).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
[ -d bench_tmp/new ] || { echo "bench_tmp/new missing: make it before the call (see above)"; exit 2; }
nvidia-smi --query-gpu=name --format=csv,noheader
(cd bench_tmp/new && PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 300 python3 -m pytest -m gpu \
  tests/kernels/test_kernels_gpu.py -k "bound_swap_in" -p no:cacheprovider -o addopts="" -q -rfEs 2>&1 | tail -3)
ARGS="--config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers on --steps 30"
for kv in fp8_e4m3 bfloat16; do
  PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc python3 benchmarks/bench_decode.py $ARGS --kv-cache-dtype $kv --hisparse-side-copy-blocks 8 16 --out $OUT/main_$kv.json > $OUT/main_$kv.log 2>&1
  grep "done:" $OUT/main_$kv.log | sed "s/.*done: /MAIN $kv /"
  (cd bench_tmp/new && PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_new python3 benchmarks/bench_decode.py $ARGS --kv-cache-dtype $kv --hisparse-side-copy-blocks 8 16 32 --out $OUT/small_$kv.json > $OUT/small_$kv.log 2>&1)
  grep "done:" $OUT/small_$kv.log | sed "s/.*done: /SMALL $kv /"
done
(cd bench_tmp/new && PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 200 python3 benchmarks/bench_swap_in.py --copy-blocks 0 4 8 16 32 --json $OUT/small_swap_caps.json > $OUT/small_swap_caps.log 2>&1; tail -12 $OUT/small_swap_caps.log)
