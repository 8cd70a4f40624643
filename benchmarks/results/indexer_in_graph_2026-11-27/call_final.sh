#!/usr/bin/env bash
# Session 20 (2026-11-27), last calls: bench_indexer.py with the streaming read as the floor and the in-graph
# timing, then the diagnostic variants (req / seq_len loads and the look-ahead scale loads taken out).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
D=benchmarks/results/indexer_in_graph_2026-11-27
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 220 python3 benchmarks/bench_indexer.py --json $OUT/${G}_bench_indexer_final.json > $OUT/${G}_bench_indexer_final.log 2>&1
echo "bench rc $?"
sed -n '/^scores in a replayed/,/^query to/p' $OUT/${G}_bench_indexer_final.log
grep -A14 "^scores: us" $OUT/${G}_bench_indexer_final.log | cut -c1-45,160-
timeout 150 python3 $D/idx_diag.py > $OUT/${G}_idx_diag.log 2>&1; echo "diag rc $?"; grep -v "^HBM\|^a one" $OUT/${G}_idx_diag.log | tail -22
