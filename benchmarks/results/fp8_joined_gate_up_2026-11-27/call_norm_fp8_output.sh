#!/usr/bin/env bash
# Session 16 (2026-11-27), stage n, as run: the RMSNorm writing the block-FP8 form of its output for the GEMM after it
# (bench_tmp/new) against the tree before (bench_tmp/old = 6ee0ab7): the new GPU tests, then the decode step
# (dsv32-bench-16l, 4K, dense, graphs) old vs new at batch 1 / 16 / 64 and the step's FP8 read rate.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
cd $ROOT/bench_tmp/new; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
timeout 150 python3 -m pytest -m gpu tests/model/test_fused_ops_gpu.py -k "fp8_output or norms_fp8" -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_nq_tests.log 2>&1
echo "new tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed|Error" $OUT/${G}_nq_tests.log | tail -8
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  timeout ${STEP_TIMEOUT:-170} python3 benchmarks/bench_fp8_step.py --batches 1 16 64 --steps 20 --out $OUT/${G}_nq_step_$tree.json > $OUT/${G}_nq_step_$tree.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_nq_step_$tree.log | head -4
done
cd $ROOT/bench_tmp/new
for tree in old new; do python3 benchmarks/fp8_step_gbps.py $OUT/${G}_nq_step_$tree.json 2>&1 | tail -6; done
