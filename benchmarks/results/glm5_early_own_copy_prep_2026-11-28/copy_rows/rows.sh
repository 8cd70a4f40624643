# Kept as it ran from bench_tmp/ (now benchmarks/results/glm5_early_own_copy_prep_2026-11-28/copy_rows/: replace the path to run it from the project root on the GPU machine, .whl/ carried)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton
cp kernels/csrc/hisparse_kernels.cu /tmp/orig.cu
for n in 1 2 4; do
  sed "s/capped ? swap_in_copy_kernel<kCappedCopyRows> : swap_in_copy_kernel<1>/capped ? swap_in_copy_kernel<kCappedCopyRows> : swap_in_copy_kernel<$n>/" /tmp/orig.cu > kernels/csrc/hisparse_kernels.cu
  grep -c "swap_in_copy_kernel<$n>" kernels/csrc/hisparse_kernels.cu
  TAG=full$n HISPARSE_KERNEL_CACHE=/tmp/kc$n timeout 150 python3 bench_tmp/rows.py 2>&1 | grep "^ROW\|Error" | tee -a $OUT/rows.log
done
cp /tmp/orig.cu kernels/csrc/hisparse_kernels.cu
