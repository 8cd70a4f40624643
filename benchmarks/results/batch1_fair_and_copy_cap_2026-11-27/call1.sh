set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
L=$OUT/log.txt
# 1. GPU tests of what changed: the router kernel (never run on a GPU), the fused ops, the capped copy grid
timeout 200 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs -m gpu tests/model/test_moe_route_gpu.py tests/model/test_fused_ops_gpu.py tests/kernels/test_kernels_gpu.py -k "route or fused or norm or rope or bound_swap" > $OUT/tests.log 2>&1
tail -4 $OUT/tests.log
# 2. copy-grid cap sweep
timeout 90 python3 benchmarks/bench_swap_in.py --copy-blocks 0 4 8 16 32 64 --json $OUT/copy_cap.json > $OUT/copy_cap.txt 2>&1
tail -30 $OUT/copy_cap.txt
# 3. rank batch 1: dense, HiSparse late, early with caps
timeout 200 python3 benchmarks/bench_decode.py --config dsv32-rank-ep8 --contexts 32768 65536 --miss-rates 0.05 --batch-sizes --max-batch 1 --skip-model-indexer-run --steps 30 --warmup 3 --host-memory-fraction 0.7 --hisparse-early-swap-in both --hisparse-side-copy-blocks 0 8 32 --out $OUT/rank_b1.json 2>&1 | grep -v "it/s\]" > $OUT/rank_b1.log
grep -E "^(dense|hisparse)" $OUT/rank_b1.log
# 4. router kernel A/B on the FP8 step
timeout 150 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 40 --out $OUT/step_router.json >> $L 2>&1
timeout 150 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 40 --eager-router --out $OUT/step_eager_router.json >> $L 2>&1
grep -E "^ *(batch|  *1 |  *16 )|rror" $L | tail -12
