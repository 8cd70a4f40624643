#!/usr/bin/env bash
# Prepared, not yet run (no device time left on 2026-11-28): the Triton kernel's FP8 RoPE part declared aligned.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 240 python3 benchmarks/results/sparse_mla_triton_rope_prep_2026-11-28/triton_rope_time.py 2>&1 \
  | tee $OUT/triton_rope.log | tail -16
