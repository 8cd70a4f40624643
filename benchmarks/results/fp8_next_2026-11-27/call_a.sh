#!/usr/bin/env bash
# Device call of 2026-11-27 (session 15), stage a, as run from the repo root with bench_tmp/old (main before this
# session, 9d3223c) and bench_tmp/new (the branch under test), carrying .whl: the FP8 GEMM and fused-op GPU tests,
# a re-tune of dsv32-bench-16l at M <= 64 into a copy of the shipped table (the new tuner: graph replay in turns;
# the grouped one-row kernel's row-program form), then the decode step old vs new at batch 1 / 16 / 64 (new reads
# the re-tuned table through HISPARSE_FP8_GEMM_TABLE).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cd $ROOT/bench_tmp/new
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  s=$SECONDS
  PYTHONPATH=/tmp/site:$PWD timeout ${TESTS_TIMEOUT:-170} python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py tests/model/test_fused_ops_gpu.py -p no:cacheprovider -o addopts="" -q -rfE -x > $OUT/${G}_tests.log 2>&1
  echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_tests.log | tail -8
fi
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
s=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout ${TUNE_TIMEOUT:-220} python3 benchmarks/tune_fp8_gemm.py --configs dsv32-bench-16l --parallel 1x1 --max-tokens 64 --out $OUT/${G}_table.json > $OUT/${G}_tune.log 2>&1
echo "tune rc $? in $((SECONDS-s)) s"; grep -E "grouped.*M≤ *(8|16|64|128|512):|wrote" $OUT/${G}_tune.log | tail -12
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; s=$SECONDS
  if [ $tree = new ]; then export HISPARSE_FP8_GEMM_TABLE=$OUT/${G}_table.json; fi
  PYTHONPATH=/tmp/site:$PWD timeout ${STEP_TIMEOUT:-100} python3 benchmarks/bench_fp8_step.py --batches ${BATCHES:-1 16 64} --steps 20 --out $OUT/${G}_step_$tree.json > $OUT/${G}_step_$tree.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A5 "^batch" $OUT/${G}_step_$tree.log | head -5
done
