set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
timeout 150 python3 bench_tmp/strand_diag.py dsv32-rank-ep8 2>&1 | grep "RESULT\|Error\|error" | tee $OUT/diag.txt
timeout 400 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/model 2>&1 | tail -5 | tee $OUT/model_tests.txt
