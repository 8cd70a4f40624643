#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfE tests/kernels/test_indexer_gpu.py tests/model/test_fused_ops_gpu.py > $OUT/tests1.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/tests1.log | tail -12
timeout ${BENCH_T:-330} python3 benchmarks/bench_indexer.py --json $OUT/bench_indexer.json > $OUT/bench_indexer.log 2>&1
echo "bench rc $?"
sed -n '/^Lightning indexer/,$p' $OUT/bench_indexer.log | head -40
