# bench_tmp/old_<slug>.json: the table of 97e61a2 (git show 97e61a2:kernels/fp8_gemm_tables/<slug>.json)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
slug=$(python3 -c 'import torch; from kernels.fp8_gemm_table import device_slug; print(device_slug(torch.cuda.get_device_name()))')
table=$OUT/$slug.json
cp bench_tmp/old_$slug.json $table
HISPARSE_FP8_GEMM_TABLE=$PWD/bench_tmp/old_$slug.json timeout 150 python3 benchmarks/bench_fp8_step.py --config glm5-bench --batches 1 16 --steps 20 --out $OUT/step_before.json > $OUT/step_before.log 2>&1
echo "before rc=$?"; tail -4 $OUT/step_before.log
for c in glm5-bench glm5-rank-ep8 glm-5; do
  timeout 150 python3 benchmarks/tune_fp8_gemm.py --configs $c --parallel 1x1 --max-tokens 256 --out $table >> $OUT/tune.log 2>&1
  echo "tune $c rc=$?"
done
timeout 150 python3 benchmarks/tune_fp8_gemm.py --configs glm-5 --parallel 8x8 --max-tokens 256 --out $table >> $OUT/tune.log 2>&1
echo "tune glm-5 8x8 rc=$?"
grep -E "wrote|decisions" $OUT/tune.log
HISPARSE_FP8_GEMM_TABLE=$table timeout 150 python3 benchmarks/bench_fp8_step.py --config glm5-bench --batches 1 16 --steps 20 --out $OUT/step_after.json > $OUT/step_after.log 2>&1
echo "after rc=$?"; tail -4 $OUT/step_after.log
