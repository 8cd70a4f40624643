#!/usr/bin/env bash
# Every GPU test and the decode-throughput benchmark, in stages that each fit one 600 s device call (the whole
# suite took ~620 s on an H100 on 2026-11-27, so it no longer fits one). Logs under $OUT (or ./gpu-out).
#   hisparse  pytest -m gpu tests/hisparse tests/deploy            (HiSparse lossless, graphs, prefetches; 2026-11-28:
#             288 s H100; H200 297 s on 2026-11-27; 59 tests since af2cfe9: 185 s warm, over 330 s cold on an H200)
#   kernels   pytest -m gpu tests/kernels                          (270 tests; the stage split off from `rest` on
#             2026-11-28, when `rest` outgrew one call on an H100: 410 tests, 365 done in 580 s)
#   rest      pytest -m gpu on every other test directory          (models, engine, parallel; ~140 tests)
#   bench     bench_decode.py at the given contexts (default 32768 65536 8192), 5 and 15 % misses
# Usage on the GPU machine, from the project root (wheels for pydantic etc. in .whl/, see docs/benchmarks.md):
#   bash benchmarks/gpu_suite.sh [hisparse] [kernels] [rest] [bench] [-- contexts...]  (no stage named: all four)
# tests/api holds no GPU test (its schemathesis module needs a wheel the image lacks, so collection would fail);
# tests/disagg/test_pd_gpu.py needs the mooncake CUDA 13 wheel: run it in a call that carries that wheel.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels}
stages=()
contexts=()
while (($#)); do
  case $1 in
    hisparse | kernels | rest | bench) stages+=("$1") ;;
    --) shift; contexts=("$@"); break ;;
    *) echo "unknown stage $1 (hisparse, kernels, rest, bench; contexts after --)" >&2; exit 2 ;;
  esac
  shift
done
((${#stages[@]})) || stages=(hisparse kernels rest bench)
((${#contexts[@]})) || contexts=(32768 65536 8192)
nvidia-smi -L
gpu_tests() {  # stage, then the test paths
  local stage=$1
  shift
  timeout "${TESTS_TIMEOUT:-560}" python3 -m pytest -m gpu "$@" -p no:cacheprovider -o addopts="" -q -rfEs \
    --durations=8 >"$OUT/gpu_tests_$stage.log" 2>&1
  echo "stage $stage: exit $? (log $OUT/gpu_tests_$stage.log)"
  grep -E "^(FAILED|ERROR)| passed| failed" "$OUT/gpu_tests_$stage.log" | tail -12
}
for stage in "${stages[@]}"; do
  case $stage in
    hisparse) gpu_tests hisparse tests/hisparse tests/deploy ;;
    kernels) gpu_tests kernels tests/kernels ;;
    rest)
      rest=()
      for path in tests/*/ tests/test_*.py; do
        path=${path%/}
        case $path in
          tests/api | tests/disagg | tests/hisparse | tests/deploy | tests/kernels | tests/__pycache__) continue ;;
        esac
        rest+=("$path")
      done
      gpu_tests rest "${rest[@]}"
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-560}" python3 benchmarks/bench_decode.py --contexts "${contexts[@]}" --steps 20 \
        --miss-rates 0.05 0.15 --out "$OUT/bench_decode.json" 2>&1 | grep -v "it/s\]" \
        | tee "$OUT/bench_decode.log" | tail -25
      ;;
  esac
done
