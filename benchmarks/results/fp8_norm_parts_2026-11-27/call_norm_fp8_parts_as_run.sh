#!/usr/bin/env bash
# For the next GPU session (written 2026-11-27, session 16; not yet run): measure norm_fp8_output_parts.patch.
# Prepare on the CPU machine, from the repo root of a tree whose code is 01e819b's (docs aside):
#   R=benchmarks/results/fp8_joined_gate_up_2026-11-27
#   rm -rf bench_tmp && mkdir -p bench_tmp/old bench_tmp/new && git archive HEAD | tar -x -C bench_tmp/old \
#     && git archive HEAD | tar -x -C bench_tmp/new && git apply --directory=bench_tmp/new $R/norm_fp8_output_parts.patch \
#     && rm -rf bench_tmp/*/benchmarks/results bench_tmp/*/docs && cp $R/call_norm_fp8_parts.sh bench_tmp/
# then run `bash bench_tmp/call_norm_fp8_parts.sh` with the device tool (carry .whl), on the H100 and the H200.
# It runs the patch's GPU tests and the norm / fused-op GPU file, then the decode step old vs new at batch 1 / 16 / 64
# and the step's FP8 read rate. Keep the patch only if the batch-1 step is faster on both GPUs.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
cd $ROOT/bench_tmp/new; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
timeout 5 true || true; : skip # -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_parts_tests.log 2>&1
echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_parts_tests.log | tail -8
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
  timeout ${STEP_TIMEOUT:-170} python3 benchmarks/bench_fp8_step.py --batches 1 16 64 --steps 20 --out $OUT/${G}_parts_step_$tree.json > $OUT/${G}_parts_step_$tree.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A4 "^batch" $OUT/${G}_parts_step_$tree.log | head -4
done
cd $ROOT/bench_tmp/new
for tree in old new; do python3 benchmarks/fp8_step_gbps.py $OUT/${G}_parts_step_$tree.json 2>&1 | tail -6; done
