#!/usr/bin/env bash
# Prepared, not yet run (2026-11-28): what slows the main stream beside the side-stream copy (issue 23 item 3).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 300 python3 benchmarks/results/side_copy_interference_prep_2026-11-28/interference.py 2>&1 \
  | tee $OUT/interference.log | tail -20
