#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (run from the project root with .whl/ carried).
# GLM-5's shared layers' stacked input projection (q_a + kv_a: N 2624, K 6144), measured into the H200 table at
# every token count 1-4096 (tuning_config now holds a shared layer).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
mkdir -p $OUT/res; cp kernels/fp8_gemm_tables/nvidia_h200.json $OUT/res/
timeout 75 python3 benchmarks/tune_fp8_gemm.py --configs glm5-rank-ep8 --parallel 1x1 --max-tokens 4096 --shapes 2624:6144 \
  --out $OUT/res/nvidia_h200.json > $OUT/res/tune_2624.log 2>&1; echo rc=$?; grep -E "wrote|N=  2624" $OUT/res/tune_2624.log | tail -15
