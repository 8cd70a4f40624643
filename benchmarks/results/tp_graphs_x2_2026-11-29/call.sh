#!/bin/bash
# Kept as it ran from bench_tmp/ (call 1: TESTS=tests/parallel/test_tp_graphs_gpu.py BENCH=1, the tp2 bench only; call 2: BENCH=1).
# Two H200s (nvidia-h200-x2): CUDA graphs + overlap scheduling with --tp-size 2 — the 2-GPU tests (new
# test_tp_graphs_gpu.py, test_tp_gpu.py, test_dp_gpu.py), then the "Two GPUs" bench: TP 2 with the new defaults
# (graphs + overlap), TP 2 as before (eager, synchronous), TP 1 on GPU 0 with its defaults (graphs + overlap).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L; git log -1 --format=%h 2>/dev/null
timeout ${TEST_S:-330} python3 -m pytest -m gpu ${TESTS:-tests/parallel} -p no:cacheprovider -o addopts="" -q -rA \
  --durations=8 >$OUT/tp_graphs_tests.log 2>&1
echo "tests exit $?"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)| passed| failed|^E  |^[0-9.]+s " $OUT/tp_graphs_tests.log | head -60
bench() {  # name, then extra args (CUDA_VISIBLE_DEVICES set by the caller)
  local name=$1; shift
  timeout ${BENCH_S:-110} python3 benchmarks/bench_decode.py --contexts 32768 --miss-rates 0.05 \
    --skip-model-indexer-run --batch-sizes 1 --device-kv-budget-gib 8 "$@" --out $OUT/bench_$name.json \
    2>&1 | grep -v "^INFO\|it/s\]" | tr '\r' '\n' | grep -v "it/s\|^ *$" | tail -14
}
if [ -n "${BENCH:-}" ]; then
  echo "== TP 2, graphs + overlap (new defaults)"; bench tp2 --tp-size 2
  echo "== TP 2, eager + synchronous (before)"; bench tp2_eager --tp-size 2 --disable-cuda-graph --disable-overlap-schedule
  echo "== TP 1 on GPU 0, graphs + overlap"; CUDA_VISIBLE_DEVICES=0 bench tp1
fi
