#!/bin/bash
# Kept as it ran from bench_tmp/ (2026-11-29, 2 x H200): both servers not ready within 180 s (default KV budgets:
# a 125 GiB pinned host pool; cold kernel cache). The test now sets 2 GiB budgets and a 420 s start limit; not run since.
# Two H200s: the 2-GPU server test (graphs on every rank, clean SIGTERM stop).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
timeout 420 python3 -m pytest -m gpu tests/api/test_api_parallel_gpu.py -p no:cacheprovider -o addopts="" -v -rA --durations=4 --timeout 400 >$OUT/server.log 2>&1
echo "== exit $?"
grep -E "PASSED|FAILED|ERROR| passed| failed|^E  |s (call|setup)" $OUT/server.log | head -40
