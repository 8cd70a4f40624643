#!/usr/bin/env bash
# The decode step on one DeepSeek-V3.2 EP 8 rank (61 layers, FP8), 32K, batch 1 and 16, dense and HiSparse (5 %
# misses): this tree (one-kernel index-key write, early-started scores) against 8a1ddac (bench_tmp/old), new / old
# / new in one call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
ARGS="--config dsv32-rank-ep8 --contexts 32768 --miss-rates 0.05 --batch-sizes 1 --max-batch 16 --skip-model-indexer-run --steps 30 --warmup 3 --host-memory-fraction 0.7"
run() {  # name, tree
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 170 python3 benchmarks/bench_decode.py $ARGS --out $OUT/step_$1.json > $OUT/step_$1.log 2>&1; echo "$1 rc $?")
  grep -o "done: .*a step" $OUT/step_$1.log
}
run new1 $PWD
run old bench_tmp/old
run new2 $PWD
