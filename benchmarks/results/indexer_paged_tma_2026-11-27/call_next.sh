#!/usr/bin/env bash
# For the next GPU session: the paged TMA scores kernel against the engine's gather kernel (time_gpu.py).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
D=benchmarks/results/indexer_paged_tma_2026-11-27
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 300 python3 $D/time_gpu.py > $OUT/${G}_paged.log 2>&1; echo "rc $?"; tail -30 $OUT/${G}_paged.log
