#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
export PYTHONPATH=/tmp/site:$PWD
timeout 100 python3 -m pytest -m gpu tests/kernels/test_fp8_gemm_gpu.py -k batched -p no:cacheprovider -o addopts="" -q -rfE > $OUT/h100_bmm_tests2.log 2>&1
echo "bmm tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/h100_bmm_tests2.log | tail -5
T=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
timeout 100 python3 benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 --parallel 1x1 8x8 --max-tokens 256 --shapes 512:128 128:512 --out $T > $OUT/h100_tune_batched2.log 2>&1
echo "tune rc $?"; tail -n 1 $OUT/h100_tune_batched2.log
cp $T $OUT/
timeout 90 python3 bench_tmp/bmm_sweep.py $OUT/h100_bmm_sweep2.json 2>&1 | tail -10
