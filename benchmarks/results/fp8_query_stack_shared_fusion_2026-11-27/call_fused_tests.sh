#!/usr/bin/env bash
# Session 17: HiSparse == dense bit for bit with the stacked query GEMM and the fused shared expert (FP8 weights,
# graphs, overlap), and the whole FP8-weights lossless file, on this GPU.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
s=$SECONDS
timeout ${T:-400} python3 -m pytest -m gpu tests/hisparse/test_fp8_weights_lossless_gpu.py tests/engine/test_fp8_weight_bytes_gpu.py -p no:cacheprovider -o addopts="" -q -rfE -s > $OUT/${G}_fused_tests.log 2>&1
echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed|FP8 GEMM decisions" $OUT/${G}_fused_tests.log | cut -c1-200 | tail -12
