set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
bash bench_tmp/dg_build.sh || exit 1
export PYTHONPATH=/tmp/dgb/dg:/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
timeout 200 python3 bench_tmp/dg_min.py 2>&1 | tail -3 || true
if ! timeout 100 python3 bench_tmp/dg_min.py >/dev/null 2>&1; then timeout 150 cuda-gdb -batch -ex run -ex bt --args python3 bench_tmp/dg_min.py 2>&1 | grep '^#' | cut -c1-200 | head -14; exit 1; fi
timeout 420 python3 bench_tmp/dg_anchor.py 2>&1 | tee $OUT/dg_anchor.log | grep -v "^{" | tail -30
cp /tmp/dg_build.log $OUT/ 2>/dev/null; true
