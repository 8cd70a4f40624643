#!/usr/bin/env bash
# Session 16 (2026-11-27), stage s, as run on the H200 and then the H100: the decode step (dsv32-bench-16l, 4K, dense, graphs) old tree 95a6d2e (routed
# gate and up apart, bf16 too) vs new (joined, the table with the joined shapes tuned) at batch 1 / 16 / 64, then the
# step's FP8 read rate from the new tree's JSON.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  timeout ${STEP_TIMEOUT:-170} python3 benchmarks/bench_fp8_step.py --batches 1 16 64 --steps 20 --out $OUT/${G}_step_$tree.json > $OUT/${G}_step_$tree.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_step_$tree.log | head -4
done
cd $ROOT/bench_tmp/new
for tree in old new; do python3 benchmarks/fp8_step_gbps.py $OUT/${G}_step_$tree.json 2>&1 | tail -12; done
