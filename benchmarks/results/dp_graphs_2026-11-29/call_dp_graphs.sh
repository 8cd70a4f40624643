#!/bin/bash
# Kept as it ran from bench_tmp/ (2026-11-29, 2 x H200, nvidia-h200-x2, commit cde8b2d): the benches and the one-GPU tests ran; the 2-GPU tests hung in destroy_process_group (see call_diag.sh).
# Two H200s (nvidia-h200-x2): CUDA graphs with DP attention — the 2-GPU tests (new test_dp_graphs_gpu.py beside
# test_dp_gpu.py and test_tp_graphs_gpu.py), the DP bench with graphs on and off, then the one-GPU graph tests (the
# runner was refactored).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L; git log -1 --format=%h 2>/dev/null
t() {  # log name, timeout, pytest args
  local name=$1 limit=$2; shift 2
  timeout $limit python3 -m pytest -m gpu "$@" -p no:cacheprovider -o addopts="" -q -rA --durations=5 >$OUT/$name.log 2>&1
  echo "== $name exit $?"
  grep -E "^(FAILED|ERROR)| passed| failed|^E  " $OUT/$name.log | head -30
}
t dp_graphs_tests 240 tests/parallel/test_dp_graphs_gpu.py tests/parallel/test_dp_gpu.py tests/parallel/test_tp_graphs_gpu.py
bench() {  # name, then extra args
  local name=$1; shift
  timeout ${BENCH_S:-120} python3 benchmarks/bench_decode.py --contexts 32768 --miss-rates 0.05 \
    --skip-model-indexer-run --batch-sizes 1 --device-kv-budget-gib 8 "$@" --out $OUT/bench_$name.json \
    2>&1 | grep -v "^INFO" | tr '\r' '\n' | grep -v "it/s\|^ *$" | tail -14
}
DP="--tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2"
echo "== DP 2 + EP 2, graphs"; bench dp2 $DP
echo "== DP 2 + EP 2, eager"; bench dp2_eager $DP --disable-cuda-graph
t graph_tests_1gpu ${G1_S:-150} tests/hisparse/test_cuda_graph_gpu.py tests/hisparse/test_overlap_gpu.py
