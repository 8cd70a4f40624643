python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
slug=$(python3 -c 'import torch; from kernels.fp8_gemm_table import device_slug; print(device_slug(torch.cuda.get_device_name()))')
table=$OUT/$slug.json
cp kernels/fp8_gemm_tables/$slug.json $table
timeout 200 python3 benchmarks/tune_fp8_gemm.py --configs deepseek-v3.2 --parallel 8x8 --max-tokens 256 --shapes 512:7168 4608:7168 --out $table > $OUT/tune.log 2>&1
echo "tune tp8 stacks rc=$?"
timeout 200 python3 benchmarks/tune_fp8_gemm.py --configs dsv32-rank-ep16 --parallel 1x1 --max-tokens 256 --shapes 2048:7168 7168:2048 --out $table >> $OUT/tune.log 2>&1
echo "tune ep16 experts rc=$?"
grep -E "wrote|decisions|N= " $OUT/tune.log | tail -40
