#!/usr/bin/env bash
# The two runs of 2026-11-28 (H200): per-program timelines and the work-queue variant (tail.py), then the L2
# prefetch variants (pf.py). ~60 s each on a warm machine.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
for script in tail pf; do
  timeout 400 python3 benchmarks/results/indexer_tail_2026-11-28/$script.py > $OUT/${G}_$script.log 2>&1
  echo "$script rc $?"
  tail -45 $OUT/${G}_$script.log
done
