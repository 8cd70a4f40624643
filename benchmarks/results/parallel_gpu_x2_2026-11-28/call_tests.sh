#!/bin/bash
# Kept as it ran from bench_tmp/ (calls 1, 5; call 6 with TESTS=tests/parallel/test_dp_gpu.py).
# Two H200s (nvidia-h200-x2): the NCCL tests that one-GPU machines skip (DP attention never ran on GPUs before),
# then the rest of tests/parallel's GPU tests.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L; nvidia-smi topo -m | head -4
git log -1 --format=%h 2>/dev/null
timeout 520 python3 -m pytest -m gpu ${TESTS:-tests/parallel} -p no:cacheprovider -o addopts="" -q -rA --durations=12 \
  >$OUT/parallel_gpu_x2.log 2>&1
echo "exit $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)| passed| failed|slowest|^[0-9.]+s " $OUT/parallel_gpu_x2.log | tail -60
