#!/usr/bin/env bash
# For the next GPU session (issue 23 item 6): the Gluon kernel's checks (short timeout: a hang, not a failure, is
# what a wrong barrier would give), then its timing against FlashMLA and the Triton kernel.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
D=benchmarks/results/sparse_mla_gluon_2026-11-28
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 120 python3 $D/time_gpu.py --check > $OUT/${G}_gluon_check.log 2>&1; echo "check rc $?"; tail -20 $OUT/${G}_gluon_check.log
timeout 240 python3 $D/time_gpu.py > $OUT/${G}_gluon_time.log 2>&1; echo "time rc $?"; tail -12 $OUT/${G}_gluon_time.log
