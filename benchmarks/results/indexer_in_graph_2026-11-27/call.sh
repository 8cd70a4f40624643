#!/usr/bin/env bash
# Session 20 (2026-11-27): bench_indexer.py with the in-graph timing of the scores kernels and the read of the same
# bytes (issue 23 item 1), then one stage of the GPU suite (STAGE: hisparse / rest / none).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout ${BENCH_S:-200} python3 benchmarks/bench_indexer.py --json $OUT/${G}_bench_indexer.json > $OUT/${G}_bench_indexer.log 2>&1
echo "bench rc $?"
sed -n '/^scores: us/,/^top-k of/p' $OUT/${G}_bench_indexer.log | cut -c1-18,130-
if [ "${STAGE:-none}" != none ]; then
  OUT=$OUT/${G}_suite TESTS_TIMEOUT=${TT:-390} bash benchmarks/gpu_suite.sh $STAGE 2>&1 | tail -14
fi
