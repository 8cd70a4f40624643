#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Prefix caching at the final tree: its GPU tests and the lossless / overlap / graph GPU tests beside them.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
nvidia-smi -L
timeout 560 python3 -m pytest -m gpu tests/hisparse/test_prefix_caching.py tests/hisparse/test_lossless.py \
  tests/hisparse/test_overlap_gpu.py tests/hisparse/test_cuda_graph_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs \
  --durations=6 2>&1 | tee $OUT/res/gpu_tests.log | tail -14
