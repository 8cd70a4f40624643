#!/usr/bin/env bash
# For a GPU session (H200 or H100, ~7 minutes; run on the UNPATCHED tree): the dense FP8 kernel with its first K tile
# the constant 0 without split-K (the grouped kernel's change of 0d10512) against the tree's, per table entry and in
# the rank's step; then the GLM-5 rank's 20 % / 0 % step (issue 23 item 3) with the faster grouped GEMM.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
nvidia-smi -L
D=benchmarks/results/dense_first_tile_2026-11-28
grep -q "FUSE_REDUCE: tl.constexpr, SPLIT_K: tl.constexpr):" kernels/fp8_gemm_triton.py \
  && { echo "run it on the unpatched tree"; exit 2; }
cp kernels/fp8_gemm_triton.py /tmp/old_fp8_gemm_triton.py
git apply $D/dense_first_tile.patch || exit 2
cp kernels/fp8_gemm_triton.py /tmp/new_fp8_gemm_triton.py
OLD_KERNEL=/tmp/old_fp8_gemm_triton.py timeout 200 python3 $D/dense_compare.py 2>&1 | grep -v Warning | tee $OUT/r/dense_compare.txt | tail -5
case "$(nvidia-smi --query-gpu=name --format=csv,noheader)" in *H100*) RANK=dsv32-rank-ep16;; *) RANK=dsv32-rank-ep8;; esac
for v in new old; do
  cp /tmp/${v}_fp8_gemm_triton.py kernels/fp8_gemm_triton.py
  timeout 150 python3 benchmarks/bench_decode.py --config $RANK --contexts 32768 --modes dense hisparse \
    --skip-model-indexer-run --miss-rates 0.05 --batch-sizes 1 --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --out $OUT/r/${RANK}_$v.json 2>&1 | grep -v "it/s\]" > $OUT/r/${RANK}_$v.log
  echo "== $RANK $v"; grep "^dense\|^hisparse\|^mode" $OUT/r/${RANK}_$v.log
done
cp /tmp/new_fp8_gemm_triton.py kernels/fp8_gemm_triton.py
if ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100; then  # GLM-5's rank needs the H200's memory
  timeout 170 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
    --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --hisparse-prefetch-shared-layers on --out $OUT/r/glm5_item3.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_item3.log
  echo "== glm5 item 3"; grep "^hisparse\|^mode" $OUT/r/glm5_item3.log
fi
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/kernels/test_fp8_gemm_gpu.py 2>&1 | tail -3 | tee $OUT/r/fp8_tests.txt
tar czf $OUT/results.tgz -C $OUT r
