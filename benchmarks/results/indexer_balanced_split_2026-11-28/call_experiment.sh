python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
timeout 240 python3 benchmarks/results/indexer_balanced_split_2026-11-28/balanced_experiment.py 2>&1 | tee $OUT/balanced.log | grep -v "^{" | tail -14
