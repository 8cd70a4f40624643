#!/usr/bin/env bash
# Kernel tests + TP heads + FlashMLA compare (product tree); the chunked-copy experiment tree's extension built in the background.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout ${T_TESTS:-240} python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs \
  tests/kernels/test_sparse_mla_gluon_gpu.py tests/kernels/test_flashmla_gpu.py tests/kernels/test_sparse_mla_plan.py \
  "tests/kernels/test_kernels_gpu.py" -k "sparse_mla or gluon or flashmla" > $OUT/${G}_tests.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed|Error" $OUT/${G}_tests.log | tail -8
timeout ${T_CMP:-280} python3 benchmarks/bench_sparse_mla.py --no-main --flashmla --tp-heads --json $OUT/${G}_flashmla_tp.json \
  > $OUT/${G}_flashmla_tp.log 2>&1; echo "bench rc $?"
grep -E "^\| (bf16|fp8) \| 128 \| (1|16|64|128) \||^\| (bf16|fp8) \| 64 \| (64|128) \|" $OUT/${G}_flashmla_tp.log
grep -A40 "TP rank" $OUT/${G}_flashmla_tp.log | head -42
