#!/usr/bin/env bash
# Plan kernel: position-owned LRU walk (new) against HEAD's (old), alternating, plus the swap-in GPU tests.
# Run as bench_tmp/swap_call.sh from the project root (bench_tmp/old: `git archive HEAD` of c655322); swap_cmp.py prints the table.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print $2}')
GRID="--buffers 4096 8192 --batches 1 16 64 128 --miss-rates 0 0.2"
new() { PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_new python3 benchmarks/bench_swap_in.py $GRID --json $OUT/new_$1_$gpu.json > $OUT/new_$1_$gpu.log 2>&1; echo "new $1 rc=$?"; }
old() { PYTHONPATH=/tmp/site:$PWD/bench_tmp/old HISPARSE_KERNEL_CACHE=/tmp/kc_old python3 benchmarks/bench_swap_in.py $GRID --json $OUT/old_$1_$gpu.json > $OUT/old_$1_$gpu.log 2>&1; echo "old $1 rc=$?"; }
t0=$(date +%s)
PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout ${TEST_LIMIT:-240} python3 -m pytest -m gpu tests/kernels/test_kernels_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs -x > $OUT/tests_$gpu.log 2>&1
echo "tests rc=$? $(( $(date +%s)-t0 )) s"; grep -E "passed|failed|^FAILED|^ERROR" $OUT/tests_$gpu.log | tail -5
old 1; new 1; old 2; new 2
echo "bench done $(( $(date +%s)-t0 )) s"
python3 bench_tmp/swap_cmp.py $OUT $gpu
