set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
mkdir -p $OUT/r; nvidia-smi -L
# 1. GLM-5's rank at batch 1: HiSparse against dense over the same synthetic selection (issue 23 item 4's form)
timeout 230 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 8192 32768 65536 --miss-rates 0.05 \
  --batch-sizes 1 --max-batch 1 --skip-model-indexer-run --dense-synthetic-topk --steps 30 --warmup 3 \
  --host-memory-fraction 0.7 --out $OUT/r/glm5_batch1.json 2>&1 | grep -v "it/s\]" > $OUT/r/glm5_batch1.log
echo "== batch 1"; grep "^hisparse\|^dense\|^mode" $OUT/r/glm5_batch1.log
tar czf $OUT/results.tgz -C $OUT r
# 2. early swap-in off and on (the full layers' own copy cap 32) in one process, 32K, 0 % and 20 %
git apply benchmarks/results/glm5_early_own_copy_prep_2026-11-28/early_own_copy.patch || exit 2
HISPARSE_EXP_EARLY_OWN_COPY_BLOCKS=32 timeout 300 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 \
  --contexts 32768 --modes hisparse --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 \
  --host-memory-fraction 0.7 --hisparse-prefetch-shared-layers on --hisparse-early-swap-in both \
  --out $OUT/r/early_both_own32.json 2>&1 | grep -v "it/s\]" > $OUT/r/early_both_own32.log
echo "== early off / on (own 32)"; grep "^hisparse\|^mode" $OUT/r/early_both_own32.log
tar czf $OUT/results.tgz -C $OUT r
