python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench_tmp/copy_floor.py
for kv in fp8_e4m3 bfloat16; do
python3 benchmarks/bench_decode.py --config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers both --kv-cache-dtype $kv --steps 20 --out $OUT/glm5_$kv.json > $OUT/glm5_$kv.log 2>&1
grep -iE "ms|step" $OUT/glm5_$kv.log | grep -v Warning | tail -12
done
