#!/usr/bin/env bash
# Padded rows' indexer lengths 0 instead of a top-k mask in every layer: the CUDA-graph HiSparse GPU tests (padded
# buckets, bit identity) and the decode step (dsv32-rank-ep8, 32K) this tree against f8b0496 (bench_tmp/old).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m pytest -m gpu tests/hisparse/test_cuda_graph_gpu.py tests/hisparse/test_cuda_graph_server_gpu.py tests/hisparse/test_fp8_weights_lossless_gpu.py -p no:cacheprovider -o addopts="" -q -rfEs > $OUT/h200_pad_tests.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed" $OUT/h200_pad_tests.log | tail -5
ARGS="--config dsv32-rank-ep8 --contexts 32768 --miss-rates 0.05 --batch-sizes 1 --max-batch 16 --skip-model-indexer-run --steps 30 --warmup 3 --host-memory-fraction 0.7"
run() {  # name, tree
  (cd $2 && PYTHONPATH=/tmp/site:$PWD timeout 120 python3 benchmarks/bench_decode.py $ARGS --out $OUT/pad_step_$1.json > $OUT/pad_step_$1.log 2>&1; echo "$1 rc $?")
  grep -o "done: .*a step" $OUT/pad_step_$1.log
}
run new $PWD
run old bench_tmp/old
