python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs tests/kernels/test_sparse_mla_gluon_gpu.py tests/kernels/test_flashmla_gpu.py > $OUT/tests_final.log 2>&1; echo "tests rc $?"; tail -2 $OUT/tests_final.log
timeout 80 python3 bench_tmp/final.py 2>&1 | tee $OUT/final.log | tail -6
