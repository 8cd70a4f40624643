python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export TRITON_CACHE_DIR=/tmp/triton
nvidia-smi --query-gpu=name --format=csv,noheader
ARGS="--config glm5-shared-bench --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates --batch-sizes 64 128 --batch-miss-rates 0 0.2 --hisparse-prefetch-shared-layers on --steps 30"
for kv in fp8_e4m3 bfloat16; do
  (cd bench_tmp/old && PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_old python3 benchmarks/bench_decode.py $ARGS --kv-cache-dtype $kv --hisparse-side-copy-blocks 64 --out $OUT/old_$kv.json > $OUT/old_$kv.log 2>&1)
  grep "done:" $OUT/old_$kv.log | sed "s/.*done: /OLD $kv /"
  PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc python3 benchmarks/bench_decode.py $ARGS --kv-cache-dtype $kv --hisparse-side-copy-blocks 8 16 --out $OUT/new_$kv.json > $OUT/new_$kv.log 2>&1
  grep "done:" $OUT/new_$kv.log | sed "s/.*done: /NEW $kv /"
done
PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc timeout 200 python3 benchmarks/bench_swap_in.py --copy-blocks 0 4 8 16 32 64 --json $OUT/swap_caps.json > $OUT/swap_caps.log 2>&1
tail -30 $OUT/swap_caps.log
