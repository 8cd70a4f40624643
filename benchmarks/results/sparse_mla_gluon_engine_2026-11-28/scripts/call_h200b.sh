bash bench_tmp/call_overlap.sh
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
timeout 130 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs tests/kernels/test_sparse_mla_gluon_gpu.py tests/kernels/test_flashmla_gpu.py > $OUT/h200_tests_final.log 2>&1; echo "tests rc $?"; tail -3 $OUT/h200_tests_final.log
