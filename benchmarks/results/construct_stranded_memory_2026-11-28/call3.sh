set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
for cfg in dsv32-rank-ep8 glm5-rank-ep8; do for impl in old new; do
  timeout 120 python3 bench_tmp/construct_mem.py $cfg $impl 2>&1 | grep RESULT | tee -a $OUT/mem.txt; done; done
timeout 240 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu tests/model/test_construct_memory_gpu.py tests/model/test_gpu_random_model.py tests/model/test_fp8_model_gpu.py 2>&1 | tail -4 | tee $OUT/tests.txt
cp bench_tmp/h200_table_shared.json kernels/fp8_gemm_tables/nvidia_h200.json
timeout 60 python3 bench_tmp/construct_mem.py glm5-rank-ep8 new 2>&1 | grep RESULT | sed 's/RESULT/RESULT+table/' | tee -a $OUT/mem.txt
RANK="--config glm5-rank-ep8 --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7"
timeout 200 python3 benchmarks/bench_decode.py $RANK --out $OUT/rank_new_table.json 2>&1 | grep -v "it/s\]" > $OUT/rank_new_table.log
grep "^hisparse\|^mode\|KV budget" $OUT/rank_new_table.log
