python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs -m gpu tests/model/test_fused_ops_gpu.py tests/hisparse/test_fp8_lossless.py > $OUT/tests.log 2>&1; echo "tests exit $?"
tail -4 $OUT/tests.log
L=$OUT/step.log
(cd bench_tmp/old && PYTHONPATH=/tmp/site:$PWD timeout 100 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 15 --kv-cache-dtype fp8_e4m3 --top-kernels 30 --out $OUT/step_old.json >> $L 2>&1)
timeout 100 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 15 --kv-cache-dtype fp8_e4m3 --top-kernels 30 --out $OUT/step_new.json >> $L 2>&1
grep -E "^ *(batch|  *1 |  *16 )|rror" $L | tail -8
