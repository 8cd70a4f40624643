python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -m gpu tests/kernels/test_kernels_gpu.py -k "bound_swap_in" -p no:cacheprovider -o addopts="" -q -rfEs 2>&1 | tail -4
python3 benchmarks/bench_decode.py --config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers on --kv-cache-dtype fp8_e4m3 --hisparse-side-copy-blocks 4 8 16 32 64 --steps 20 --out $OUT/glm5_fp8_caps.json > $OUT/glm5_fp8_caps.log 2>&1
grep "done:" $OUT/glm5_fp8_caps.log | sed 's/.*done: //'
python3 benchmarks/bench_decode.py --config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers on --kv-cache-dtype bfloat16 --hisparse-side-copy-blocks 8 16 64 --steps 20 --out $OUT/glm5_bf16_caps.json > $OUT/glm5_bf16_caps.log 2>&1
grep "done:" $OUT/glm5_bf16_caps.log | sed 's/.*done: //'
