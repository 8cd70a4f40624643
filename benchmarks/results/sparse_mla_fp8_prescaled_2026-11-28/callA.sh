#!/usr/bin/env bash
# Session 21, call A: prebuild both trees' CUDA extensions in the background while timing the paged TMA scores
# kernel (item 1) and the prescaled Triton MLA (item 6).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
(PYTHONPATH=/tmp/site:$PWD python3 -m decode_server.ops build-kernels --arch 90a --cache-dir /tmp/kc > $OUT/build_main.log 2>&1; echo "build main rc $?" >> $OUT/build_main.log) &
(cd bench_tmp/new && PYTHONPATH=/tmp/site:$PWD python3 -m decode_server.ops build-kernels --arch 90a --cache-dir /tmp/kc_new > $OUT/build_new.log 2>&1; echo "build new rc $?" >> $OUT/build_new.log) &
bash benchmarks/results/indexer_paged_tma_2026-11-27/call_next.sh
bash benchmarks/results/sparse_mla_prescaled_2026-11-27/call_next.sh
wait
tail -2 $OUT/build_main.log $OUT/build_new.log
