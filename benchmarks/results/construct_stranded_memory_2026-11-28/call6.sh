set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
for cfg in dsv32-rank-ep8 glm5-rank-ep8; do
  timeout 60 python3 bench_tmp/construct_mem.py $cfg new 2>&1 | grep RESULT | tee -a $OUT/mem.txt; done
timeout 120 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu -s tests/model/test_construct_memory_gpu.py tests/model/test_gpu_random_model.py 2>&1 | grep "stranded after\|passed\|failed\|FAILED\|Error" | tail -8 | tee $OUT/tests.txt
timeout 360 bash benchmarks/gpu_suite.sh hisparse > $OUT/hisparse.log 2>&1; echo "hisparse rc=$?"; tail -3 $OUT/hisparse.log
