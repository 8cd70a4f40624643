#!/usr/bin/env bash
# The norm-FP8-output parts patch's GPU tests: tests/model (fused ops, FP8 model) and the FP8 GEMM tests, new tree.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
cd bench_tmp/new; export PYTHONPATH=/tmp/site:$PWD; s=$SECONDS
timeout ${T:-540} python3 -m pytest -m gpu tests/model tests/kernels/test_fp8_gemm_gpu.py tests/kernels/test_fp8_attached_quantized.py -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_parts_tests_model.log 2>&1
echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_parts_tests_model.log | tail -8
