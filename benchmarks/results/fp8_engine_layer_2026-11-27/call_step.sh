#!/usr/bin/env bash
# Session 18 (2026-11-27): the decode step FP8 vs bf16 (dsv32-bench-16l, graphs) for the old tree (690add6: grouped
# keys tuned on one random routing) and the new one (grouped keys re-tuned on the even routing samples), each step's
# FP8 read rate, then the FP8 GEMM + MoE GPU tests on the new tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
run() {  # tree dir, label, extra args
  cd $1; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  timeout ${STEP_TIMEOUT:-170} python3 benchmarks/bench_fp8_step.py --batches ${BATCHES:-1 16 64} --steps 20 $3 --out $OUT/${G}_step_$2.json > $OUT/${G}_step_$2.log 2>&1
  echo "step $2 rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_step_$2.log | head -4; cd $ROOT
}
run $ROOT/bench_tmp/old old ""
run $ROOT new ""
export PYTHONPATH=/tmp/site:$ROOT
for t in old new; do python3 benchmarks/fp8_step_gbps.py $OUT/${G}_step_$t.json 2>&1 | tail -6; done
left=$(( ${TEST_END:-585} - SECONDS )); s=$SECONDS
[ $left -gt 30 ] && { timeout $left python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py tests/model/test_moe_dispatch_gpu.py -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_tests.log 2>&1; echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_tests.log | tail -6; }
