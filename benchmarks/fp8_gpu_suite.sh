#!/usr/bin/env bash
# Issue 21 (FP8 weights) on one GPU in one device run: the FP8 GPU tests, the GEMM benchmark and the whole-step
# benchmark, each under its own timeout (one that fails or runs out does not stop the others); logs and JSON under
# $OUT (default ./gpu-out), the short table of benchmarks/fp8_summary.py last.
# Usage on the GPU machine, from the project root (wheels for pydantic etc. in .whl/, as for gpu_suite.sh):
#   bash benchmarks/fp8_gpu_suite.sh [tune] [tests] [gemm] [step]        (default: tests gemm step)
# tune: measure this GPU's FP8 GEMM table afresh (tune_fp8_gemm.py: DeepSeek-V3.2 and GLM-5 at TP1 and TP8/EP8,
# the one-rank and FP8 bench configs: the layouts tests/kernels/test_fp8_gemm_table.py holds every table to) into
# $OUT/<gpu>.json, which the later stages of the same call then use
# ($HISPARSE_FP8_GEMM_TABLE); copy it to kernels/fp8_gemm_tables/ to ship it.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 FP8_RESULTS_DIR=$OUT \
  HISPARSE_KERNEL_CACHE=${HISPARSE_KERNEL_CACHE:-/tmp/hisparse-kernels} TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton}
stages=("${@:-tests gemm step}")
stages=" ${stages[*]} "
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
if [[ $stages == *" tune "* ]]; then
  table="$OUT/$(python3 -c 'import torch; from kernels.fp8_gemm_table import device_slug; print(device_slug(torch.cuda.get_device_name()))').json"
  rm -f "$table"
  timeout "${FP8_TUNE_TIMEOUT:-300}" python3 benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 glm-5 \
    --parallel 1x1 8x8 --max-tokens 256 --out "$table" >"$OUT/tune_fp8_gemm.log" 2>&1 \
    && timeout "${FP8_TUNE_TIMEOUT:-300}" python3 benchmarks/tune_fp8_gemm.py --configs dsv32-bench-16l \
      dsv32-rank-ep8 dsv32-rank-ep16 glm5-rank-ep8 glm5-bench --parallel 1x1 --max-tokens 256 --out "$table" \
      >>"$OUT/tune_fp8_gemm.log" 2>&1
  echo "tune_fp8_gemm: exit $? (log $OUT/tune_fp8_gemm.log, table $table)"
  [[ -s $table ]] && export HISPARSE_FP8_GEMM_TABLE=$table
fi
if [[ $stages == *" tests "* ]]; then
  timeout "${FP8_TESTS_TIMEOUT:-320}" python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfE -s \
    tests/kernels/test_fp8_gemm_gpu.py tests/hisparse/test_fp8_weights_lossless_gpu.py \
    tests/engine/test_fp8_weight_bytes_gpu.py tests/model/test_fp8_model_gpu.py \
    --junitxml="$OUT/fp8_tests.xml" >"$OUT/fp8_tests.log" 2>&1
  echo "FP8 GPU tests: exit $? (log $OUT/fp8_tests.log)"
fi
if [[ $stages == *" gemm "* ]]; then
  timeout "${FP8_GEMM_TIMEOUT:-140}" python3 benchmarks/bench_fp8_gemm.py --m 1 16 64 128 256 \
    --out "$OUT/bench_fp8_gemm.json" >"$OUT/bench_fp8_gemm.log" 2>&1
  echo "bench_fp8_gemm: exit $? (log $OUT/bench_fp8_gemm.log)"
fi
if [[ $stages == *" step "* ]]; then
  timeout "${FP8_STEP_TIMEOUT:-120}" python3 benchmarks/bench_fp8_step.py --batches 1 16 64 \
    --out "$OUT/bench_fp8_step.json" >"$OUT/bench_fp8_step.log" 2>&1
  echo "bench_fp8_step: exit $? (log $OUT/bench_fp8_step.log)"
fi
python3 benchmarks/fp8_summary.py "$OUT" | tee "$OUT/fp8_summary.txt"
