python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python3 -m pytest -m gpu tests -p no:cacheprovider -o addopts="" -q -rfEs --ignore=tests/api --ignore=tests/disagg > $OUT/gpu_suite.log 2>&1
echo "exit $?"
tail -15 $OUT/gpu_suite.log
