#!/usr/bin/env bash
# H100 second call (2026-11-27, session 15, same warm machine), as run: the new GPU tests again (the first call's
# 120 s ran out compiling), the step old vs new (the re-tuned table now in the new tree) at batch 16 / 64 (batch 1
# came back from the first call), and bench_fp8_gemm at M 1 / 16 / 64.
set -uo pipefail
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
ROOT=$PWD; G=h100
cd $ROOT/bench_tmp/new; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
timeout 170 python3 -m pytest -m gpu tests/model/test_fused_ops_gpu.py tests/kernels/test_fp8_gemm_gpu.py -k "fused_ops or silu or swiglu or grouped_gemv or graph_replays or tuner" -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_new_tests.log 2>&1
echo "new tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_new_tests.log | tail -8
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  timeout 150 python3 benchmarks/bench_fp8_step.py --batches 16 64 --steps 20 --out $OUT/${G}_step_${tree}_b16_64.json >> $OUT/${G}_steps_b16_64.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A3 "^batch" $OUT/${G}_steps_b16_64.log | tail -3
done
cd $ROOT/bench_tmp/new; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
timeout 90 python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1
echo "gemm rc $? in $((SECONDS-s)) s"; tail -4 $OUT/${G}_gemm.log
