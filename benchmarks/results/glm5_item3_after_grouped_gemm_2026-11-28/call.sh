#!/usr/bin/env bash
# glm5-rank-ep8 32K, prefetch on, with the grouped GEMM of 0d10512: the side copy's cap swept (0 % and 20 % misses),
# then traces of 0 % / 20 % at the default cap and where the 20 % step loses time.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT/r
timeout 330 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 \
  --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --hisparse-side-copy-blocks 4 6 8 12 \
  --out $OUT/r/glm5_caps.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_caps.log
echo "caps rc=${PIPESTATUS[0]}"
grep "^hisparse\|^mode" $OUT/r/glm5_caps.log
tar czf $OUT/results.tgz -C $OUT r
mkdir -p /tmp/prof
timeout 200 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 \
  --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --profile-dir /tmp/prof \
  --out $OUT/r/glm5_prof.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_prof.log
echo "prof rc=${PIPESTATUS[0]}"
grep "^hisparse\|^mode" $OUT/r/glm5_prof.log
a=$(ls /tmp/prof/profile_hisparse-m0*.trace.json | head -1); b=$(ls /tmp/prof/profile_hisparse-m20*.trace.json | head -1)
gzip -c "$b" > $OUT/r/m20_trace.json.gz; gzip -c "$a" > $OUT/r/m0_trace.json.gz
python3 benchmarks/results/glm5_rank_side_copy_2026-11-28/trace_beside_copy.py $OUT/r/m0_trace.json.gz $OUT/r/m20_trace.json.gz 2>&1 | head -40 | tee $OUT/r/trace_beside_copy.txt
tar czf $OUT/results.tgz -C $OUT r
