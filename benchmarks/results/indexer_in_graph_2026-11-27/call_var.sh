#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout 120 python3 benchmarks/results/indexer_in_graph_2026-11-27/read_floor.py > $OUT/${G}_read_floor.log 2>&1; echo "read rc $?"; tail -22 $OUT/${G}_read_floor.log
timeout 200 python3 benchmarks/results/indexer_in_graph_2026-11-27/idx_var.py > $OUT/${G}_idx_var.log 2>&1; echo "var rc $?"; grep -v "^HBM\|^a one" $OUT/${G}_idx_var.log | tail -40
timeout 150 ncu --target-processes all -k regex:_scores_kernel -c 1 -s 3 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats python3 benchmarks/results/indexer_in_graph_2026-11-27/ncu_one.py > $OUT/${G}_ncu.txt 2>&1; echo "ncu rc $?"
grep -E "DRAM Throughput|Memory Throughput|Duration|Stall|Warp Cycles Per Issued|Achieved Occupancy|Registers|Eligible|Issued Warp|One or More" $OUT/${G}_ncu.txt | head -40
