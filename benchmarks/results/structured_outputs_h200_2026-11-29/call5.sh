#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run by the device tool from the repository root; $OUT is its output folder).
# Structured outputs: per-step grammar cost at a 129280-token (synthetic byte-level) vocabulary with the logits
# processing rows, then the GPU tests of structured outputs, logits processing, syncs, overlap and graphs.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res
nvidia-smi -L
python3 -c "import xgrammar; print('xgrammar ok')"
timeout 150 python3 benchmarks/bench_logits_processing.py --batch-sizes 1 16 64 128 --grammar --json $OUT/res/bench_logits_processing.json 2>&1 | tail -12
timeout 400 python3 -m pytest -m gpu tests/hisparse/test_structured_output.py tests/hisparse/test_logits_processing.py \
  tests/hisparse/test_decode_syncs_gpu.py tests/hisparse/test_overlap_gpu.py tests/hisparse/test_cuda_graph_gpu.py \
  -p no:cacheprovider -o addopts="" -q -rfEs --durations=5 > $OUT/res/gpu_tests.log 2>&1
echo "tests exit $?"
grep -E "^(FAILED|ERROR)|^E  | passed| failed|^[0-9.]+s " $OUT/res/gpu_tests.log | tail -14
