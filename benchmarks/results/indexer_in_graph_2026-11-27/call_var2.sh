#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 200 python3 benchmarks/results/indexer_in_graph_2026-11-27/idx_var.py > $OUT/${G}_idx_var2.log 2>&1; echo "var rc $?"; grep -v "^HBM\|^a one" $OUT/${G}_idx_var2.log | tail -40
timeout 150 ncu --target-processes all -k regex:_scores_kernel -c 1 -s 3 --section WarpStateStats --section SourceCounters --print-details all python3 benchmarks/results/indexer_in_graph_2026-11-27/ncu_one.py > $OUT/${G}_ncu2.txt 2>&1; echo "ncu rc $?"
grep -iE "stall|warp cycles" $OUT/${G}_ncu2.txt | head -40
