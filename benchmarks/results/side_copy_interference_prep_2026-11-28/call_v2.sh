#!/usr/bin/env bash
set -uo pipefail
export PYTHONPATH=/tmp/site:/tmp/exp HISPARSE_KERNEL_CACHE=/tmp/kc_exp TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if [ ! -d /tmp/exp ]; then echo "machine was not warm: no /tmp/exp"; exit 3; fi
cp bench_tmp/interference2.py /tmp/exp/
cd /tmp/exp && timeout 400 python3 interference2.py 2>&1 | tee $OUT/interference2.log | tail -40
