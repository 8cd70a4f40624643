#!/usr/bin/env bash
# Issue 23 item 6: the Gluon kernel as the `triton` backend's kernel on Hopper (kernels/sparse_mla_gluon.py).
# GPU tests (new Gluon tests, the Triton and FlashMLA sparse MLA tests), then FlashMLA / Triton / Gluon at every
# batch of the split sweep, then the Gluon split sweep. Logs and JSON under $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then G=h200; else G=h100; fi
timeout ${T_TESTS:-240} python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -q -rfEs -x \
  tests/kernels/test_sparse_mla_gluon_gpu.py tests/kernels/test_flashmla_gpu.py \
  "tests/kernels/test_kernels_gpu.py" -k "sparse_mla or gluon or flashmla" > $OUT/${G}_tests.log 2>&1
echo "tests rc $?"; grep -E "^(FAILED|ERROR)| passed| failed|Error" $OUT/${G}_tests.log | tail -8
timeout ${T_CMP:-200} python3 benchmarks/bench_sparse_mla.py --no-main --flashmla --json $OUT/${G}_flashmla.json \
  > $OUT/${G}_flashmla.log 2>&1; echo "flashmla compare rc $?"
grep -E "^\| (bf16|fp8) \| 128 \| (1|16|64|128) \|" $OUT/${G}_flashmla.log
[ -n "${SKIP_SWEEP:-}" ] || timeout ${T_SWEEP:-150} python3 benchmarks/bench_sparse_mla.py --no-main --splits-gluon --json $OUT/${G}_splits_gluon.json \
  > $OUT/${G}_splits_gluon.log 2>&1; echo "gluon sweep rc $?"; [ -n "${SKIP_SWEEP:-}" ] || grep -E "ratio|worst" $OUT/${G}_splits_gluon.log | awk '$NF+0 > 1.05 || /worst/' | tail -12
