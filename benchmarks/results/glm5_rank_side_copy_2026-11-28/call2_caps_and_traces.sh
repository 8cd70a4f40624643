#!/usr/bin/env bash
# glm5-rank-ep8 32K, 20 % misses, prefetch on: the side copy's block cap swept; then traces of 0 % and 20 %.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
timeout 300 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 \
  --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --hisparse-side-copy-blocks 4 8 16 32 \
  --out $OUT/glm5_caps.json 2>&1 | grep -v "it/s\]" > $OUT/glm5_caps.log
echo "caps rc=${PIPESTATUS[0]}"
grep -v "^              " $OUT/glm5_caps.log | grep "^hisparse\|^mode"
mkdir -p /tmp/prof
timeout 240 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 \
  --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --profile-dir /tmp/prof \
  --out $OUT/glm5_prof.json 2>&1 | grep -v "it/s\]" > $OUT/glm5_prof.log
echo "prof rc=${PIPESTATUS[0]}"
grep "^hisparse\|^mode" $OUT/glm5_prof.log
ls -la /tmp/prof
cp /tmp/prof/*.txt $OUT/ 2>/dev/null
a=$(ls /tmp/prof/profile_hisparse-m0*.trace.json | head -1); b=$(ls /tmp/prof/profile_hisparse-m20*.trace.json | head -1)
# (its stream split does not hold for graph replays: trace_beside_copy.py on the copied traces instead)
python3 bench_tmp/trace_overlap.py "$a" "$b" 2>&1 | tee $OUT/trace_overlap.txt
gzip -c "$b" > $OUT/m20_trace.json.gz; gzip -c "$a" > $OUT/m0_trace.json.gz; ls -la $OUT
