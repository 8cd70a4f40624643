#!/usr/bin/env bash
# Second GPU call (issue 23 item 6): the classic-order and P-in-registers variants, checked then timed.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
D=benchmarks/results/sparse_mla_gluon_2026-11-28
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 200 python3 $D/time_gpu.py --check > $OUT/${G}_gluon2_check.log 2>&1; echo "check rc $?"; grep -v ": ok" $OUT/${G}_gluon2_check.log | tail -20; grep -c ": ok" $OUT/${G}_gluon2_check.log
timeout 300 python3 $D/time_gpu.py > $OUT/${G}_gluon2_time.log 2>&1; echo "time rc $?"; tail -30 $OUT/${G}_gluon2_time.log
