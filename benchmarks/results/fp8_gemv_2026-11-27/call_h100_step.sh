#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi -L
ROOT=$PWD
export PYTHONPATH=/tmp/site:$ROOT
T=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
for s in ${RETUNE:-}; do
  timeout 60 python3 benchmarks/tune_fp8_gemm.py --configs dsv32-bench-16l --parallel 1x1 --max-tokens 1 --shapes $s --out $T > $OUT/retune_$s.log 2>&1
  echo "retune $s rc $?"; grep -E "FP8 GEMM dense.*M≤1:" $OUT/retune_$s.log | sed 's/.*FP8 GEMM //' | cut -c1-200
done
cp $T $OUT/
for cfg in dsv32-bench-16l glm5-bench; do
  for tree in old new; do
    if [ $tree = old ]; then cd $ROOT/bench_tmp/old; else cd $ROOT; fi
    PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_fp8_step.py --config $cfg --batches 1 --steps 20 --out $OUT/step_${cfg}_$tree.json > $OUT/step_${cfg}_$tree.log 2>&1
    echo "$cfg $tree rc $?"; grep -A2 "^batch" $OUT/step_${cfg}_$tree.log | head -3
  done
done
