#!/usr/bin/env bash
# Kept as it ran from bench_tmp/ (beside.py first, then beside2.py: the last line named each in turn).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/te
nvidia-smi -L
timeout 400 python3 bench_tmp/beside2.py 2>&1 | grep -v Warning
