# Kept as it ran from bench_tmp/ (now benchmarks/results/glm5_early_own_copy_prep_2026-11-28/host_pages/: replace the path to run it from the project root on the GPU machine, .whl/ carried)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi -L
timeout 300 python3 bench_tmp/thp.py 2>&1 | grep -v Warn | tee $OUT/thp.log | tail -40
