#!/usr/bin/env bash
# One device run: every GPU test, then the decode-throughput benchmark, logs under $OUT (or ./gpu-out).
# Usage on the GPU machine, from the project root (wheels for pydantic etc. in .whl/, see docs/benchmarks.md):
#   bash benchmarks/gpu_suite.sh [contexts...]        default contexts: 32768 65536 8192
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels}
contexts=("${@:-32768 65536 8192}")
nvidia-smi -L
# tests/api holds no GPU test; its schemathesis module needs a wheel the image lacks (collection would fail).
# tests/disagg/test_pd_gpu.py needs the mooncake CUDA 13 wheel: run it in a call that carries that wheel.
timeout 420 python3 -m pytest -m gpu tests -p no:cacheprovider -o addopts="" -q --ignore=tests/api \
  --ignore=tests/disagg 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -8
timeout 370 python3 benchmarks/bench_decode.py --contexts ${contexts[*]} --steps 20 --miss-rates 0.05 0.15 \
  --out "$OUT/bench_decode.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/bench_decode.log" | tail -25
