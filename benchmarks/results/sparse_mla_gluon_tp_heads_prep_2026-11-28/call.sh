#!/usr/bin/env bash
# Prepared, not yet run (2026-11-28): TP ranks' 16 / 32 heads through the Gluon kernel padded to 64 heads.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 300 python3 benchmarks/results/sparse_mla_gluon_tp_heads_prep_2026-11-28/heads_time.py 2>&1 \
  | tee $OUT/heads.log | tail -24
