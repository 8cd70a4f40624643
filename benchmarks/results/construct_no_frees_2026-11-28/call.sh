#!/usr/bin/env bash
# For the next GPU session (H200 or H100, ~6 minutes): the construction that never frees (stacks made on the meta
# tree with the target device as their home), against the tree's (6938f6a: module by module, freed segments handed
# back). Run it on the unpatched tree: it keeps the tree's construct.py as the "old" one, then applies the patch.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
D=benchmarks/results/construct_no_frees_2026-11-28
grep -q "def point_at" decode_server/model/fused_linear.py && { echo "run it on the unpatched tree"; exit 2; }
cp decode_server/model/construct.py /tmp/construct_old.py
git apply $D/construct_no_frees.patch || exit 2
export OLD_CONSTRUCT=/tmp/construct_old.py
for cfg in dsv32-rank-ep8 glm5-rank-ep8; do for impl in old new; do
  timeout 120 python3 $D/mem.py $cfg $impl 2>&1 | grep "RESULT\|Error" | tee -a $OUT/mem.txt; done; done
timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -q -m gpu -s tests/model 2>&1 \
  | grep "stranded after\|passed\|failed\|FAILED\|Error" | tail -8 | tee $OUT/model_tests.txt
