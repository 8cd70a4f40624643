#!/usr/bin/env bash
# GLM-5's rank at 32K: the side copy on 4 blocks with 8 rows a warp in flight (narrow_cap.patch: caps <= 4 take
# swap_in_copy_kernel<8>) against "auto" (8 blocks at batch 44, 4 rows a warp): the same rows in flight on half
# the SMs. The capped-copy GPU tests first (caps 1 and 3 run the 8-row kernel with the patch).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
git apply benchmarks/results/glm5_narrow_side_copy_2026-11-28/narrow_cap.patch || exit 2
timeout 170 python3 -m pytest -m gpu tests/kernels/test_kernels_gpu.py -k bound_swap_in -p no:cacheprovider -o addopts="" \
  -q -rfEs > $OUT/gpu_tests_capped_copy.log 2>&1
tail -2 $OUT/gpu_tests_capped_copy.log
timeout 380 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
  --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
  --hisparse-prefetch-shared-layers on --hisparse-side-copy-blocks auto 4 \
  --out $OUT/glm5_narrow_cap_32k.json 2>&1 | grep -v "it/s\]" > $OUT/glm5_narrow_cap_32k.log
grep "^hisparse\|^mode" $OUT/glm5_narrow_cap_32k.log
