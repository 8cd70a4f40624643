#!/usr/bin/env bash
# Issue 22 in one device call: decode at a real deployment's shape, one EP rank of DeepSeek-V3.2 on one GPU with
# memory planned like the server (bench_decode.py --plan-memory, the rank configs' default): FP8 weights drawn on
# the GPU, FP8 KV rows, the engine's own KV budget at mem_fraction_static 0.85, HiSparse's pinned host pool sized
# for its batch and capped at HOST_FRACTION (default 0.7) of the host's available memory (the device machine has
# 128 GiB of host memory for one GPU; a real 8-GPU node ~250 GB a GPU: where the pool binds, the JSON says so).
# The config follows the GPU's memory: dsv32-rank-ep8 (32 experts, ~97 GiB of weights) on an H200,
# dsv32-rank-ep16 (16 experts, ~58 GiB) on an H100 (CONFIG=... overrides).
# Stages, each its own process and timeout (one that fails or runs out does not stop the others; each JSON is
# written after every run, so a stage cut short keeps what finished):
#   tests   the issue-22 CPU and GPU tests (rank configs, planner fit, the rank model's GPU build, a short run)
#   32k     dense, HiSparse on the model's own indexer (random weights: the worst case), 5/15/20 % misses, batch 1
#   64k     dense, HiSparse at 5/15/20 % misses, batch 1
#   128k    the same at 128K
#   sweep   32K, the first SWEEP_LAYERS (16) layers, device KV of 0.25 0.5 1 2 GiB per layer: dense and 5 % misses
# BENCH_ARGS adds bench_decode.py flags to every stage (e.g. "--hisparse-early-swap-in both"; "--dense-synthetic-topk"
# adds dense runs over HiSparse's synthetic selection, the fair batch-1 baseline: docs/benchmarks.md).
# Usage on the GPU machine, from the project root (wheels for pydantic etc. in .whl/, as for gpu_suite.sh):
#   bash benchmarks/rank_gpu_suite.sh [tests] [32k] [64k] [128k] [sweep]       (default: all; timeouts sum to 570 s)
# Outputs under $OUT (default ./gpu-out): rank_<stage>.json / .log / .png, rank_sweep_sweep.png; the short table of
# benchmarks/rank_summary.py last (also rank_summary.txt).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 \
  HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
stages=("${@:-tests 32k 64k 128k sweep}")
stages=" ${stages[*]} "
nvidia-smi -L
grep -E "MemTotal|MemAvailable" /proc/meminfo
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [[ -z ${CONFIG:-} ]]; then
  if (( mem_mib > 100000 )); then CONFIG=dsv32-rank-ep8; else CONFIG=dsv32-rank-ep16; fi
fi
echo "GPU memory ${mem_mib} MiB: config $CONFIG; host pool cap ${HOST_FRACTION:-0.7} x MemAvailable"
common=(--config "$CONFIG" --steps "${STEPS:-10}" --warmup 2 --host-memory-fraction "${HOST_FRACTION:-0.7}" ${BENCH_ARGS:-})
bench() {  # stage timeout args...
  local stage=$1 limit=$2
  shift 2
  timeout "$limit" python3 benchmarks/bench_decode.py "${common[@]}" "$@" --out "$OUT/rank_$stage.json" \
    2>&1 | grep -v "it/s\]" >"$OUT/rank_$stage.log"
  echo "stage $stage: exit ${PIPESTATUS[0]} (log $OUT/rank_$stage.log)"
}
if [[ $stages == *" tests "* ]]; then
  timeout "${RANK_TESTS_TIMEOUT:-90}" python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfE \
    tests/engine/test_bench_rank.py tests/engine/test_roofline.py >"$OUT/rank_tests.log" 2>&1
  echo "stage tests: exit $? (log $OUT/rank_tests.log)"
fi
if [[ $stages == *" 32k "* ]]; then
  bench 32k "${RANK_32K_TIMEOUT:-140}" --contexts 32768 --miss-rates 0.05 0.15 0.2 --batch-sizes 1 \
    --batch-miss-rates 0.05
fi
if [[ $stages == *" 64k "* ]]; then
  bench 64k "${RANK_64K_TIMEOUT:-120}" --contexts 65536 --miss-rates 0.05 0.15 0.2 --skip-model-indexer-run \
    --batch-sizes 1 --batch-miss-rates 0.05
fi
if [[ $stages == *" 128k "* ]]; then
  bench 128k "${RANK_128K_TIMEOUT:-100}" --contexts 131072 --miss-rates 0.05 0.15 0.2 --skip-model-indexer-run \
    --batch-sizes 1 --batch-miss-rates 0.05
fi
if [[ $stages == *" sweep "* ]]; then
  bench sweep "${RANK_SWEEP_TIMEOUT:-120}" --num-layers "${SWEEP_LAYERS:-16}" --contexts \
    --sweep-kv-gib-per-layer 0.25 0.5 1 2 --sweep-context 32768 --sweep-miss-rates 0.05
fi
python3 benchmarks/rank_summary.py "$OUT" --plot "$OUT/rank_context.png" | tee "$OUT/rank_summary.txt"
