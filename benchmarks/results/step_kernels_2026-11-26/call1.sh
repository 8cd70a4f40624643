set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "GPU: $GPU"
L=$OUT/log.txt
# 1. plan kernel under ncu (source-level), B 64 and B 1 hit-only
python3 bench_tmp/plan_probe.py 64 >> $L 2>&1
ncu --kernel-name regex:swap_in_plan --launch-skip 5 --launch-count 1 --set full --import-source yes -o /tmp/plan64 python3 bench_tmp/plan_probe.py 64 >> $L 2>&1
ncu -i /tmp/plan64.ncu-rep --page details --print-details all > $OUT/ncu_plan64_details.txt 2>&1
ncu -i /tmp/plan64.ncu-rep --page source --csv --print-source cuda > $OUT/ncu_plan64_cuda.csv 2>&1
ncu -i /tmp/plan64.ncu-rep --page source --csv --print-source sass > /tmp/plan64_sass.csv 2>&1
gzip -c /tmp/plan64_sass.csv > $OUT/ncu_plan64_sass.csv.gz
# 2. FP8 step before tuning (the H200 table lacks the gate/up stacks)
timeout 200 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 80 --out $OUT/step_before.json >> $L 2>&1
if echo "$GPU" | grep -q H200; then
  timeout 120 python3 benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 --parallel 1x1 --max-tokens 256 --shapes 4096:7168 36864:7168 --out kernels/fp8_gemm_tables/nvidia_h200.json >> $L 2>&1
  cp kernels/fp8_gemm_tables/nvidia_h200.json $OUT/
  timeout 200 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 80 --out $OUT/step_after.json >> $L 2>&1
fi
grep -v "^ *$" $L | grep -E "^ *(batch|  *1 |  *16 )|wrote|rror|Traceback" | tail -20
