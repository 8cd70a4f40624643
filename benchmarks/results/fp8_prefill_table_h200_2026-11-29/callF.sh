#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried); callF wrote the GPU-suite folder's fp8 log.
# The FP8 GPU tests with the final H200 table (prefill buckets 512-4096 measured).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
timeout 250 python3 -m pytest -m gpu tests/model/test_fp8_model_gpu.py tests/hisparse/test_fp8_weights_lossless_gpu.py \
  tests/kernels/test_fp8_gemm_gpu.py tests/engine/test_fp8_weight_bytes_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs -s \
  >$OUT/res/fp8_tests.log 2>&1
echo "rc=$?"; grep -E "FP8-MODEL|passed|failed" $OUT/res/fp8_tests.log | cut -c1-250 | tail -12
