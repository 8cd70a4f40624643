# ruff: noqa  -- kept as it ran on the device, 2026-11-28 (commit 479f0d9)
#!/usr/bin/env bash
# The balanced split as the default: bench_indexer.py (its new `mixed` table and the main tables) and the
# indexer's GPU tests.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
nvidia-smi -L
git rev-parse --short HEAD 2>/dev/null
timeout 300 python3 benchmarks/bench_indexer.py --json $OUT/${G}_bench_indexer.json > $OUT/${G}_bench_indexer.log 2>&1
echo "bench rc $?"
timeout 150 python3 -m pytest -m gpu tests/kernels/test_indexer_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs > $OUT/${G}_indexer_tests.log 2>&1
echo "tests rc $?"
grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_indexer_tests.log | tail -8
sed -n '/^scores: us/,/^top-k of/p' $OUT/${G}_bench_indexer.log | cut -c1-200 | grep -v "^$" | head -60
