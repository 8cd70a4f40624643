python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/hisparse-kernels
timeout 300 python3 -m pytest -m gpu $(cat bench_tmp/remaining.txt) -p no:cacheprovider -o addopts="" -q -rfEs --durations=5 > $OUT/gpu_tests_rest_tail.log 2>&1
echo "rc $?"; tail -12 $OUT/gpu_tests_rest_tail.log
