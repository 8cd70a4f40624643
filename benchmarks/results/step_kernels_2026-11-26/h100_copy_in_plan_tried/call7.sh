python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs -m gpu tests/kernels/test_kernels_gpu.py -k "swap_in" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log
R="--config dsv32-rank-ep16 --contexts 8192 32768 65536 --miss-rates 0.05 --batch-sizes --max-batch 1 --skip-model-indexer-run --steps 10 --warmup 2 --host-memory-fraction 0.7"
HISPARSE_SWAP_IN_COPY_IN_PLAN_MAX_BATCH=0 timeout 60 python3 benchmarks/bench_decode.py $R --out $OUT/rank_b1_copykernel.json > $OUT/rank_b1_copykernel.log 2>&1
timeout 60 python3 benchmarks/bench_decode.py $R --out $OUT/rank_b1_inplan.json > $OUT/rank_b1_inplan.log 2>&1
grep -hE "^(dense|hisparse)" $OUT/rank_b1_copykernel.log $OUT/rank_b1_inplan.log | cut -c1-75
HISPARSE_SWAP_IN_COPY_IN_PLAN_MAX_BATCH=0 timeout 40 python3 benchmarks/bench_swap_in.py --quick > $OUT/swap_copykernel.txt 2>&1
timeout 40 python3 benchmarks/bench_swap_in.py --quick > $OUT/swap_inplan.txt 2>&1
grep -hE "^\| (1152|656) \| 4096 \| 1 \|" $OUT/swap_copykernel.txt $OUT/swap_inplan.txt
