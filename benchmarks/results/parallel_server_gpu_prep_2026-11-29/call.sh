#!/bin/bash
# Prepared, not run yet (2026-11-29): the next call on two GPUs (kind nvidia-h200-x2, carry .whl). The new 2-GPU
# server test (TP HiSparse and DP-attention servers with CUDA graphs; SIGTERM must end them cleanly — the production
# path of Engine.close() before destroy_process_group), then the 2-GPU engine tests again.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L; git log -1 --format=%h 2>/dev/null
t() {  # log name, timeout, pytest args
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m pytest -m gpu "$@" -p no:cacheprovider -o addopts="" -v -rA --durations=8 --timeout 440 >$OUT/$name.log 2>&1
  echo "== $name exit $?"
  grep -E "PASSED|FAILED|ERROR| passed| failed|^E  " $OUT/$name.log | head -40
}
t servers 480 tests/api/test_api_parallel_gpu.py
t engines 300 tests/parallel/test_dp_graphs_gpu.py tests/parallel/test_dp_gpu.py tests/parallel/test_tp_graphs_gpu.py
