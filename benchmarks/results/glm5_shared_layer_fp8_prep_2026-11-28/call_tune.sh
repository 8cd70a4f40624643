#!/usr/bin/env bash
# For the next GPU sessions, once on an H200 and once on an H100 (both tables must hold the new keys before the patch
# can land: tests/kernels/test_fp8_gemm_table.py checks every shipped table). Apply the patch to the tree first:
#   git apply benchmarks/results/glm5_shared_layer_fp8_prep_2026-11-28/tuning_config_shared_layer.patch
# Tunes the stacked input projection of GLM-5's shared layers (q_a + kv_a, no indexer wk: N 2624, K 6144; today
# it runs unstacked, kv_a N 576 on the untimed default kernel) into this GPU's table, runs the table tests, and on
# the H200 times glm5-rank-ep8's 0 % / 20 % step with the table before (HEAD's, restored from git) and after.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
nvidia-smi -L
grep -q '"shared" in config.indexer_types' decode_server/model/fp8_warmup.py || { echo "apply the patch first"; exit 2; }
table=$(python3 -c "import torch; from kernels.fp8_gemm_table import table_path; print(table_path(torch.cuda.get_device_name()))")
cp "$table" $OUT/table_before.json
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
RANK="--config glm5-rank-ep8 --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --max-batch 41 --steps 10 --warmup 2 --host-memory-fraction 0.7"
if (( mem_mib > 100000 )); then
  timeout 200 python3 benchmarks/bench_decode.py $RANK --out $OUT/rank_before.json 2>&1 | grep -v "it/s\]" > $OUT/rank_before.log
fi
timeout 200 python3 benchmarks/tune_fp8_gemm.py --configs glm5-rank-ep8 --parallel 1x1 --max-tokens 256 \
  --shapes 2624:6144 > $OUT/tune.log 2>&1
echo "tune rc=$?"; tail -3 $OUT/tune.log; cp "$table" $OUT/table_after.json
timeout 120 python3 -m pytest -p no:cacheprovider -o addopts="" -q tests/kernels/test_fp8_gemm_table.py > $OUT/table_tests.log 2>&1
echo "table tests rc=$? (the other GPU's table fails until its own call)"; tail -3 $OUT/table_tests.log
if (( mem_mib > 100000 )); then
  timeout 200 python3 benchmarks/bench_decode.py $RANK --out $OUT/rank_after.json 2>&1 | grep -v "it/s\]" > $OUT/rank_after.log
  grep "^hisparse\|^mode" $OUT/rank_before.log $OUT/rank_after.log
fi
