#!/usr/bin/env bash
# The variants (pdl.py), run twice on an H200 on 2026-11-28 (h200_variants_1.log: the first variant list — product
# kernel's body without PDL, PDL waiting first, tables early, tables and q early, + the first keys' L2 prefetch;
# h200_variants_2.log: pdl.py as kept, with the prefetch of the first 1 / 2 / 4 blocks' rows, keys and scales).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 250 python3 benchmarks/results/indexer_early_start_2026-11-28/pdl.py > $OUT/${G}_pdl.log 2>&1
echo "rc $?"
tail -50 $OUT/${G}_pdl.log
