set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton
nvidia-smi --query-gpu=name --format=csv,noheader
python3 bench_tmp/mla_var.py --flashmla 2>&1 | tee $OUT/variants.log | grep -v "^|" 
for f in bf16 fp8; do
  timeout 150 ncu --kernel-name regex:_sparse_mla_decode_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis python3 bench_tmp/ncu_one.py $f > $OUT/ncu_$f.txt 2>&1
  grep -E "Duration|Throughput|Registers|Shared Memory|Achieved Occupancy|Stall|Warp Cycles|Issued|Eligible|L2 Hit|Mem Busy|Max Bandwidth|Theoretical Occ|Block Limit" $OUT/ncu_$f.txt | head -60
done
grep "^|" $OUT/variants.log
