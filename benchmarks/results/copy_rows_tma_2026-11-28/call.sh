#!/bin/bash
# Kept as it ran from bench_tmp/ (the script then lived at bench_tmp/tma_copy.py).
set -e
export TORCH_EXTENSIONS_DIR=/tmp/te
nvidia-smi --query-gpu=name,pcie.link.gen.current,pcie.link.width.current --format=csv
timeout 500 python3 bench_tmp/tma_copy.py 2>&1 | tee $OUT/tma_copy.log | tail -90
