python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
# 1. where batch 1's extra time goes: traces of replayed steps, dense and HiSparse, 32K, batch 1
timeout 200 python3 benchmarks/bench_decode.py --config dsv32-rank-ep8 --contexts 32768 --miss-rates 0.05 --batch-sizes --max-batch 1 --skip-model-indexer-run --steps 20 --warmup 3 --host-memory-fraction 0.7 --profile-dir $OUT/prof --out $OUT/rank_b1_prof.json 2>&1 | grep -v "it/s\]" > $OUT/rank_b1_prof.log
grep -E "^(dense|hisparse)" $OUT/rank_b1_prof.log
gzip $OUT/prof/*.trace.json; ls -la $OUT/prof
# 2. GLM-5 shared-layer prefetch with the side-stream copy cap
timeout 250 python3 benchmarks/bench_decode.py --config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers both --hisparse-side-copy-blocks 0 16 32 --steps 10 --out $OUT/glm5_prefetch_caps.json 2>&1 | grep -v "it/s\]" > $OUT/glm5_prefetch_caps.log
grep -E "^hisparse" $OUT/glm5_prefetch_caps.log
