# Kept as it ran from bench_tmp/ (now benchmarks/results/glm5_early_own_copy_prep_2026-11-28/host_pages/: replace the path to run it from the project root on the GPU machine, .whl/ carried)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
mkdir -p $OUT/r; nvidia-smi -L
run() {
  timeout 140 python3 benchmarks/bench_decode.py --config glm5-rank-ep8 --contexts 32768 --modes hisparse \
    --skip-model-indexer-run --miss-rates 0 0.2 --batch-sizes --steps 10 --warmup 2 --host-memory-fraction 0.7 \
    --hisparse-prefetch-shared-layers on --out $OUT/r/$1.json 2>&1 | grep -v "it/s\]" > $OUT/r/$1.log
  echo "== $1"; grep "^hisparse\|^mode\|model built" $OUT/r/$1.log
}
run thp_on
sed -i 's/^    advise_huge_pages(mapping)$/    pass  # advise_huge_pages(mapping)/' decode_server/engine/pinned.py
grep -c "pass  # advise" decode_server/engine/pinned.py
run thp_off
