python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
timeout 125 python3 -m pytest -m gpu tests/kernels/test_indexer_gpu.py -p no:cacheprovider -o addopts="" -q -x 2>&1 | tail -4
timeout 95 python3 benchmarks/results/indexer_balanced_split_2026-11-28/integrated_variants.py 2>&1 | tee $OUT/bal2.log | grep -v "^{" | tail -12
