#!/usr/bin/env bash
# For the next GPU session (issue 23 item 3): the capped side-stream copy in 2-warp blocks (small_capped_blocks.patch)
# against main's 8-warp blocks, same call: the bound swap-in GPU tests on the patched tree, then glm5-shared-bench
# (prefetch on, 32K, 0 % / 20 % misses, FP8 and bf16 rows) on both trees, and bench_swap_in's copy caps alone.
# Run from the project root of main; the patched copy goes to bench_tmp/new (not committed).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
D=benchmarks/results/side_copy_small_blocks_2026-11-27
rm -rf bench_tmp/new && mkdir -p bench_tmp/new && git ls-files -z | xargs -0 -I{} cp --parents {} bench_tmp/new/ 2>/dev/null
(cd bench_tmp/new && patch -p1 -s < ../../$D/small_capped_blocks.patch) || exit 1
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
