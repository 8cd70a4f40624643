python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p /tmp/prof
timeout 200 python3 benchmarks/bench_decode.py --config dsv32-rank-ep8 --contexts 32768 --modes hisparse --miss-rates 0.05 --batch-sizes --max-batch 1 --skip-model-indexer-run --steps 20 --warmup 3 --host-memory-fraction 0.7 --profile-dir /tmp/prof --out /tmp/rank_b1_prof_h.json 2>&1 | grep -v "it/s\]" > /tmp/rank_b1_prof_h.log
grep -E "^(dense|hisparse)" /tmp/rank_b1_prof_h.log
gzip -c /tmp/prof/profile_hisparse-m5_32768.trace.json > $OUT/profile_hisparse-m5_32768.trace.json.gz
timeout 250 python3 benchmarks/bench_decode.py --config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers on --hisparse-side-copy-blocks 0 32 64 --steps 30 --out /tmp/glm5_caps2.json 2>&1 | grep -v "it/s\]" > /tmp/glm5_caps2.log
grep -E "^hisparse" /tmp/glm5_caps2.log
tar czf $OUT/call3_rest.tgz /tmp/rank_b1_prof_h.json /tmp/rank_b1_prof_h.log /tmp/glm5_caps2.json /tmp/glm5_caps2.log /tmp/prof/*.txt
