#!/usr/bin/env bash
# Device calls of 2026-11-27 (session 14), as run: branch moe-fused-dispatch (7563fb9, in bench_tmp/new) against main
# (6ef3fa2, in bench_tmp/old), from the repo root, carrying .whl. This script ran once on an H200 (without the
# bench_fp8_gemm lines at its end, which ran as the next call on the same machine) and once on an H100. The whole GPU
# suite on the branch tree: `cd bench_tmp/new && TESTS_TIMEOUT=560 bash benchmarks/gpu_suite.sh rest` (H200) and
# `... gpu_suite.sh hisparse` (H200, H100); logs *_gpu_tests_*.log. step_gbps.py (now benchmarks/fp8_step_gbps.py) reads the step JSONs afterwards (CPU).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
cd $ROOT/bench_tmp/new
s=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -m gpu tests/model/test_moe_dispatch_gpu.py tests/model/test_fp8_model_gpu.py -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_moe_tests.log 2>&1
echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_moe_tests.log | tail -8
for tree in old new; do
  cd $ROOT/bench_tmp/$tree; s=$SECONDS
  PYTHONPATH=/tmp/site:$PWD timeout ${STEP_TIMEOUT:-200} python3 benchmarks/bench_fp8_step.py --batches ${BATCHES:-1 16 64} --steps 20 --out $OUT/${G}_step_$tree.json > $OUT/${G}_step_$tree.log 2>&1
  echo "step $tree rc $? in $((SECONDS-s)) s"; grep -A5 "^batch" $OUT/${G}_step_$tree.log | head -5
done
cd $ROOT/bench_tmp/new; s=$SECONDS
PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1
echo "gemm rc $? in $((SECONDS-s)) s"; tail -4 $OUT/${G}_gemm.log
