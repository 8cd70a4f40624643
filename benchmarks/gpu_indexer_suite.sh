#!/usr/bin/env bash
# Issue 23 items 1-2 in one device run: the indexer / top-k GPU tests, then the indexer benchmark (HBM fraction of
# the scores kernels, top-k vs torch.topk, whole call old vs new). Logs and JSON under $OUT (default ./gpu-out);
# the test summary and the benchmark's tables are printed last. Fits the 10-minute limit of one device command.
#   bash benchmarks/gpu_indexer_suite.sh            # tests + benchmark (~6-8 min on a fresh machine)
#   bash benchmarks/gpu_indexer_suite.sh --configs  # the scores kernel's launch-shape sweep only (~4 min)
#   bash benchmarks/gpu_indexer_suite.sh --engine   # HiSparse == dense GPU tests on the new path (needs .whl:
#                                                   # ../shared/tools/device-wheels.sh serve test; carry .whl)
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels}
nvidia-smi -L | tee "$OUT/device.txt"
PYTEST=(python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -v -rfE)
case "${1:-}" in
  --configs)
    timeout 560 python3 benchmarks/bench_indexer.py --configs --no-main --json "$OUT/bench_indexer_configs.json" \
      > "$OUT/bench_indexer_configs.log" 2>&1
    echo "bench exit $?"; sed -n '/^Lightning indexer/,$p' "$OUT/bench_indexer_configs.log"
    ;;
  --engine)
    timeout 560 "${PYTEST[@]}" tests/hisparse/test_lossless.py tests/hisparse/test_fp8_lossless.py \
      tests/hisparse/test_decode_syncs_gpu.py tests/hisparse/test_cuda_graph_gpu.py > "$OUT/engine_tests.log" 2>&1
    echo "pytest exit $?"; grep -cE " PASSED" "$OUT/engine_tests.log"; grep -E " (FAILED|ERROR)|passed|failed" \
      "$OUT/engine_tests.log" | tail -25
    ;;
  *)
    timeout 300 "${PYTEST[@]}" tests/kernels/test_topk_gpu.py tests/kernels/test_indexer_gpu.py \
      "tests/kernels/test_kernels_gpu.py::test_indexer_gpu_matches_reference" > "$OUT/gpu_tests.log" 2>&1
    tests_rc=$?
    timeout 270 python3 benchmarks/bench_indexer.py --json "$OUT/bench_indexer.json" > "$OUT/bench_indexer.log" 2>&1
    bench_rc=$?
    echo "== GPU tests (exit $tests_rc; full log $OUT/gpu_tests.log): $(grep -c " PASSED" "$OUT/gpu_tests.log") passed"
    grep -E " (FAILED|ERROR)|^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -20
    echo "== bench_indexer (exit $bench_rc; log $OUT/bench_indexer.log, JSON $OUT/bench_indexer.json)"
    sed -n '/^Lightning indexer/,$p' "$OUT/bench_indexer.log"
    ;;
esac
