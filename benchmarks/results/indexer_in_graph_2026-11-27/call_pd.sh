#!/usr/bin/env bash
# tests/disagg on the GPU with the mooncake CUDA 13 wheel (carried in two parts over two calls: it and the tree
# exceed one call's 64 MiB together).
set -uo pipefail
W=mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl
mkdir -p /tmp/pdw && cat /tmp/pdparts/part_aa .whl_pd2/part_ab > /tmp/pdw/$W && md5sum /tmp/pdw/$W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl /tmp/pdw/$W >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import mooncake.engine; print('mooncake ok')" 2>&1 | tail -2
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout ${SUITE_S:-480} python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs --durations=10 --timeout 240 tests/disagg > $OUT/${G}_gpu_disagg.log 2>&1
echo "disagg rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|Timeout" $OUT/${G}_gpu_disagg.log | tail -12
