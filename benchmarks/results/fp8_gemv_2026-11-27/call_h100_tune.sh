#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 200 python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py -p no:cacheprovider -o addopts="" -q -rfE -x > $OUT/fp8_gemm_tests.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/fp8_gemm_tests.log | tail -8
T=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
echo "table $T"
i=0
for c in "deepseek-v3.2 --parallel 1x1 8x8" "dsv32-bench-16l --parallel 1x1" "glm5-bench --parallel 1x1" "glm5-rank-ep8 --parallel 1x1" "glm-5 --parallel 1x1 8x8" "dsv32-rank-ep16 --parallel 1x1"; do
  i=$((i+1)); s=$SECONDS
  timeout ${TUNE_T:-100} python3 benchmarks/tune_fp8_gemm.py --configs $c --max-tokens 1 --out $T > $OUT/tune_$i.log 2>&1
  echo "tune $c: rc $? in $((SECONDS-s)) s"; grep -E "FP8 GEMM dense.*M≤1:" $OUT/tune_$i.log | sed 's/.*FP8 GEMM //' | cut -c1-150 | head -12
done
cp $T $OUT/
