#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 150 python3 benchmarks/bench_indexer.py --json $OUT/bench_indexer.json > $OUT/bench_indexer.log 2>&1
echo "bench rc $?"
sed -n '/^scores: us/,/^top-k of/p' $OUT/bench_indexer.log | cut -c1-18,130-
TESTS_TIMEOUT=${TT:-400} bash benchmarks/gpu_suite.sh ${STAGE:-rest} 2>&1 | tail -14
