#!/usr/bin/env bash
# H100 call of 2026-11-27 (session 15), as run: stages a, b and c of the H200's calls in one: the new GPU tests
# (tuner graph timing, grouped one-row row-program form, SwiGLU kernel), the re-tune of dsv32-bench-16l and of the
# real configurations at M <= 64 into a copy of the shipped table, then the step old (9d3223c) vs new (reading the
# re-tuned table through HISPARSE_FP8_GEMM_TABLE) at batch 1 / 16 / 64, and bench_fp8_gemm at M 1 / 16 / 64.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; SLUG=nvidia_h200; else G=h100; SLUG=nvidia_h100_80gb_hbm3; fi
cd $ROOT/bench_tmp/new
export PYTHONPATH=/tmp/site:$PWD
s=$SECONDS
timeout 120 python3 -m pytest -m gpu tests/model/test_fused_ops_gpu.py tests/kernels/test_fp8_gemm_gpu.py -k "fused_ops or silu or swiglu or grouped_gemv or graph_replays or tuner" -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_new_tests.log 2>&1
echo "new tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_new_tests.log | tail -8
cp kernels/fp8_gemm_tables/$SLUG.json $OUT/${G}_table.json
for job in "dsv32-bench-16l:1x1" "deepseek-v3.2:1x1 8x8" "glm-5:1x1 8x8" "glm5-bench dsv32-rank-ep16:1x1"; do
  s=$SECONDS; name=${job%%:*}
  timeout 120 python3 benchmarks/tune_fp8_gemm.py --configs $name --parallel ${job#*:} --max-tokens 64 --out $OUT/${G}_table.json >> $OUT/${G}_tune.log 2>&1
  echo "tune $job rc $? in $((SECONDS-s)) s"; tail -1 $OUT/${G}_tune.log
done
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  if [ $tree = new ]; then export HISPARSE_FP8_GEMM_TABLE=$OUT/${G}_table.json; fi
  timeout 110 python3 benchmarks/bench_fp8_step.py --batches 1 16 64 --steps 20 --out $OUT/${G}_step_$tree.json >> $OUT/${G}_steps.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_steps.log | tail -4
done
unset HISPARSE_FP8_GEMM_TABLE
s=$SECONDS
timeout 100 python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1
echo "gemm rc $? in $((SECONDS-s)) s"; tail -4 $OUT/${G}_gemm.log
