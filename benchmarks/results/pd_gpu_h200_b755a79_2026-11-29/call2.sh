#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (carry: .whl/pd2 = the wheel's second 25 MB, .whl/srv = .whl/ less flashmla).
# tests/disagg on the GPU (single-rank PD on CUDA; the TP PD tests are CPU tests and skip nothing here but run on
# CPU ranks) with the mooncake CUDA 13 wheel carried in two parts over two calls (call 1 copied part_aa to /tmp).
set -uo pipefail
W=mooncake_transfer_engine_cuda13-0.3.14-cp312-cp312-manylinux_2_28_x86_64.whl
mkdir -p /tmp/pdw && cat /tmp/pdparts/part_aa .whl/pd2/part_ab > /tmp/pdw/$W && md5sum /tmp/pdw/$W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/srv/*.whl /tmp/pdw/$W >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import mooncake.engine; print('mooncake ok')" 2>&1 | tail -2
timeout 400 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs --durations=10 tests/disagg > $OUT/h200_gpu_disagg.log 2>&1
echo "disagg rc $?"; grep -E "^(FAILED|ERROR)|passed|failed|Timeout" $OUT/h200_gpu_disagg.log | tail -12
