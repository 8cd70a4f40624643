#!/bin/bash
# Kept as it ran from bench_tmp/ (calls 2-4 ran it with diag_wide, diag_fp32, diag_sel in turn; the scripts then lived in bench_tmp/).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
timeout 540 python3 bench_tmp/diag_sel.py 2>&1 | grep -v "^INFO\|it/s" | tee $OUT/diag_sel.log | tail -60
