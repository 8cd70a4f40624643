set -uo pipefail
# Recorded call (2026-11-27), run from the project root as bench_tmp/call2.sh with bench_tmp/idx_exp.py (the copy here).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
OUT=${OUT:-$PWD/gpu-out}; mkdir -p $OUT
t0=$(date +%s)
timeout 200 python3 bench_tmp/idx_exp.py > $OUT/idx_exp.log 2>&1; echo "idx rc=$? $(( $(date +%s)-t0 )) s"
TESTS_TIMEOUT=${TT:-420} bash benchmarks/gpu_suite.sh hisparse 2>&1 | tail -8
echo "total $(( $(date +%s)-t0 )) s"
grep -E "^\|" $OUT/idx_exp.log | head -80
