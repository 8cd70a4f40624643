#!/usr/bin/env bash
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
ROOT=$PWD; cd bench_tmp/new
PYTHONPATH=/tmp/site:$PWD timeout 170 python3 -m pytest -m gpu tests/model/test_fused_ops_gpu.py tests/kernels/test_indexer_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs -x 2>&1 | tail -15
PYTHONPATH=/tmp/site:$PWD timeout 100 python3 chains_only.py > $OUT/chains.log 2>&1; echo "chains rc $?"; grep -E "\||rror" $OUT/chains.log | tail -14
for tree in old new; do
  cd $ROOT/bench_tmp/$tree
  PYTHONPATH=/tmp/site:$PWD timeout 150 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --out $OUT/fp8_step_$tree.json > $OUT/fp8_step_$tree.log 2>&1; echo "fp8_step $tree rc $?"
  grep -v "it/s" $OUT/fp8_step_$tree.log | tail -14
done
