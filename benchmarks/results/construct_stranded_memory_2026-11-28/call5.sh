set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
for cfg in dsv32-rank-ep8 glm5-rank-ep8; do for impl in old new; do
  timeout 120 python3 bench_tmp/construct_mem.py $cfg $impl 2>&1 | grep RESULT | tee -a $OUT/mem.txt; done; done
timeout 100 python3 bench_tmp/strand_diag.py dsv32-rank-ep8 2>&1 | grep "RESULT" | head -8 | tee $OUT/diag.txt
timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu -s tests/model/test_construct_memory_gpu.py tests/model tests/engine/test_fp8_weight_bytes_gpu.py 2>&1 | grep "stranded after\|passed\|failed\|FAILED\|Error" | tail -12 | tee $OUT/tests.txt
