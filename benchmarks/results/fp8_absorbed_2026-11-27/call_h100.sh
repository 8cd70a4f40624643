#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT
G=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && echo h200 || echo h100)
s=$SECONDS
timeout 150 python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py -k batched -p no:cacheprovider -o addopts="" -q -rfE -x > $OUT/${G}_bmm_tests.log 2>&1
echo "bmm tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_bmm_tests.log | tail -5
T=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
s=$SECONDS
timeout 150 python3 benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 --parallel 1x1 8x8 --max-tokens 256 --shapes 512:128 128:512 --out $T > /tmp/tune.log 2>&1
echo "tune rc $? in $((SECONDS-s)) s"; grep -E "^batched" /tmp/tune.log | cut -c1-100 | head -40; tail -n 1 /tmp/tune.log
cp $T $OUT/
timeout 120 python3 bench_tmp/bmm_sweep.py $OUT/${G}_bmm_sweep.json 2>&1 | tail -12
s=$SECONDS
timeout 200 python3 -m pytest -m gpu tests/model/test_fp8_model_gpu.py tests/engine/test_fp8_weight_bytes_gpu.py -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_model_tests.log 2>&1
echo "model tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_model_tests.log | tail -8
for tree in old new; do
  if [ $tree = old ]; then cd $ROOT/bench_tmp/old; else cd $ROOT; fi
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --out $OUT/${G}_step_$tree.json > /tmp/step_$tree.log 2>&1
  echo "step $tree rc $?"; grep -A3 "^batch" /tmp/step_$tree.log | head -4
done
