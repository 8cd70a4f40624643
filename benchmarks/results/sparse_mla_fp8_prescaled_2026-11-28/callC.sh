#!/usr/bin/env bash
# Session 21, call C: the final sparse MLA change (prescaled FP8 tiles, unmasked index loads, refitted split model):
# kernel GPU tests, the HiSparse GPU stage (lossless, graphs, prefetches), then the split sweep + FlashMLA table.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
(timeout 120 python3 benchmarks/bench_sparse_mla.py --splits --flashmla --quick --no-main --json $OUT/${G}_sparse_mla.json > $OUT/${G}_sparse_mla.log 2>&1; echo "bench rc $?" >> $OUT/${G}_sparse_mla.log) 
timeout 150 python3 -m pytest -m gpu tests/kernels/test_kernels_gpu.py -k "sparse_mla" tests/kernels/test_flashmla_gpu.py \
  -p no:cacheprovider -o addopts="" -q -rfEs > $OUT/${G}_tests.log 2>&1; echo "kernel tests rc $?"; tail -2 $OUT/${G}_tests.log
TESTS_TIMEOUT=420 bash benchmarks/gpu_suite.sh hisparse 2>&1 | tail -3; tail -3 $OUT/gpu_tests_hisparse.log
tail -1 $OUT/${G}_sparse_mla.log; grep "worst chosen" $OUT/${G}_sparse_mla.log
grep "^| fp8 | 128 | 64 \|^| bf16 | 128 | 64 \|^| fp8 | 128 | 128 \|^| bf16 | 128 | 128 " $OUT/${G}_sparse_mla.log
grep "ratio" $OUT/${G}_sparse_mla.log | awk '$NF > 1.03' | head
