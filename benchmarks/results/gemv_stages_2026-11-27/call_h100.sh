#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD/bench_tmp/new; cd $ROOT
export PYTHONPATH=/tmp/site:$ROOT
s=$SECONDS
timeout 200 python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py tests/model/test_fp8_model_gpu.py -p no:cacheprovider -o addopts="" -q -rfE > $OUT/tests.log 2>&1
echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/tests.log | tail -8
T=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
i=0
for c in "dsv32-rank-ep16 --parallel 1x1" "glm5-rank-ep8 --parallel 1x1" "glm-5 --parallel 1x1 8x8" "glm5-bench --parallel 1x1" "deepseek-v3.2 --parallel 1x1 8x8" "dsv32-bench-16l --parallel 1x1"; do
  i=$((i+1)); s=$SECONDS
  timeout 80 python3 benchmarks/tune_fp8_gemm.py --configs $c --max-tokens 2 --out $T > $OUT/tune_$i.log 2>&1
  echo "tune $c: rc $? in $((SECONDS-s)) s"; grep -cE "gemv|ls3" $OUT/tune_$i.log
done
cp $T $OUT/
for tree in old new; do
  if [ $tree = old ]; then cd $ROOT/../old; else cd $ROOT; fi
  PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_fp8_step.py --batches 1 --steps 20 --out $OUT/step_$tree.json > $OUT/step_$tree.log 2>&1
  echo "step $tree rc $?"; grep -A2 "^batch" $OUT/step_$tree.log | head -3
done
cd $ROOT
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 benchmarks/bench_fp8_step.py --batches 1 --steps 20 --out $OUT/step_new2.json > $OUT/step_new2.log 2>&1
echo "step new2 rc $?"; grep -A2 "^batch" $OUT/step_new2.log | head -3
