#!/usr/bin/env bash
# Prepared, not yet run (2026-11-28): the Triton sparse MLA kernel with 8 warps at 16 / 32 heads (~60 s).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 240 python3 benchmarks/results/sparse_mla_triton_warps_2026-11-28/time_warps.py 2>&1 \
  | tee $OUT/triton_warps.log | tail -24
