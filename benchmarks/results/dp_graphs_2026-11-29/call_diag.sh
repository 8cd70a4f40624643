#!/bin/bash
# Kept as it ran from bench_tmp/ (2026-11-29, 2 x H200): where the 2-GPU DP graph test hung — both ranks in
# destroy_process_group after all four engines finished (h200x2_destroy_hang_diag.log). dp_diag.py beside it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/results/dp_graphs_2026-11-29 PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
timeout 330 python3 benchmarks/results/dp_graphs_2026-11-29/dp_diag.py 100 300 > $OUT/diag.log 2>&1; echo "diag exit $?"
grep -E "^\[rank|all ranks|Error|error" $OUT/diag.log | head -40
