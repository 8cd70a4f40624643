#!/usr/bin/env bash
# The bound swap-in kernel tests (the "auto" cap) and the whole hisparse GPU stage with "auto" the default.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs \
  tests/kernels/test_kernels_gpu.py -k "bound_swap_in" > $OUT/kernel_tests.log 2>&1
echo "kernel tests rc=$?"; tail -2 $OUT/kernel_tests.log
TESTS_TIMEOUT=420 OUT=$OUT bash benchmarks/gpu_suite.sh hisparse > $OUT/hisparse_stage.log 2>&1
echo "hisparse stage rc=$?"; grep -E "passed|failed|error" $OUT/hisparse_stage.log | tail -3; ls $OUT
