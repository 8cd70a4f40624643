#!/usr/bin/env bash
# The early-started scores in the engine: the indexer's GPU tests, the HiSparse GPU stage (bit identity with and
# without graphs) and bench_indexer.py (the scores after the key write, in the graph).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
nvidia-smi -L
timeout 230 python3 benchmarks/bench_indexer.py --json $OUT/${G}_bench_indexer.json > $OUT/${G}_bench_indexer.log 2>&1
echo "bench rc $?"
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -m gpu tests/kernels/test_indexer_gpu.py tests/hisparse -p no:cacheprovider -o addopts="" -q -rfEs --durations=5 > $OUT/${G}_tests.log 2>&1
echo "tests rc $?"
grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_tests.log | tail -8
sed -n '/^scores in a replayed/,/^query to/p' $OUT/${G}_bench_indexer.log | cut -c1-14,100-
grep "^index-key write" $OUT/${G}_bench_indexer.log
