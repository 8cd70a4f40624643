#!/usr/bin/env bash
# Session 19 (2026-11-27): per-projection-kind FP8 read rate at M 1 / 16 / 64 with the decode-routing tuner,
# including the layer as the engine runs it (fused inputs, fused queries, shared expert in the grouped GEMMs), then
# the FP8 model GPU tests that the tuner change had not rerun.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
s=$SECONDS
timeout 200 python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 --out $OUT/${G}_gemm.json > $OUT/${G}_gemm.log 2>&1
echo "gemm rc $? in $((SECONDS-s)) s"
left=$(( ${TEST_END:-560} - SECONDS )); s=$SECONDS
[ $left -gt 30 ] && { timeout $left python3 -m pytest -m gpu ${TESTS:-tests/model/test_fp8_model_gpu.py tests/hisparse/test_fp8_weights_lossless_gpu.py tests/engine/test_fp8_weight_bytes_gpu.py} -p no:cacheprovider -o addopts="" -q -rfE > $OUT/${G}_tests.log 2>&1; echo "tests rc $? in $((SECONDS-s)) s"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/${G}_tests.log | tail -6; }
grep -E "^one MoE|M=|%HBM" $OUT/${G}_gemm.log | head -3
grep -E "^(inputs|queries|routed\+shared|o_proj|one MoE)" $OUT/${G}_gemm.log
