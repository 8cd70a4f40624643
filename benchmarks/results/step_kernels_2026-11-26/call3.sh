python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
L=$OUT/log.txt
# 1. swap-in before/after (same call): old tree (HEAD) and this tree, each with its own extension cache
(cd bench_tmp/old && HISPARSE_KERNEL_CACHE=/tmp/kc_old PYTHONPATH=/tmp/site:$PWD timeout 200 python3 benchmarks/bench_swap_in.py --quick --json $OUT/swap_old.json > /tmp/swap_old.txt 2>&1)
HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 200 python3 benchmarks/bench_swap_in.py --quick --json $OUT/swap_new.json > /tmp/swap_new.txt 2>&1
(cd bench_tmp/old && HISPARSE_KERNEL_CACHE=/tmp/kc_old PYTHONPATH=/tmp/site:$PWD timeout 100 python3 benchmarks/bench_swap_in.py --quick --json $OUT/swap_old2.json > /tmp/swap_old2.txt 2>&1)
cat /tmp/swap_old.txt /tmp/swap_new.txt /tmp/swap_old2.txt >> $L
# 2. GPU tests of what changed
HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 300 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rfEs -m gpu tests/model/test_fused_ops_gpu.py tests/kernels/test_kernels_gpu.py tests/hisparse/test_lossless.py tests/hisparse/test_cuda_graph_gpu.py > $OUT/tests.log 2>&1
tail -5 $OUT/tests.log
# 3. decode step, fused element-wise ops against eager, same tree
HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 200 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 60 --out $OUT/step_fused.json >> $L 2>&1
HISPARSE_KERNEL_CACHE=/tmp/kc_new timeout 200 python3 benchmarks/bench_fp8_step.py --batches 1 16 --steps 20 --top-kernels 60 --eager-ops --out $OUT/step_eager.json >> $L 2>&1
grep -E "^\| (1152|656) \| 4096 \| (1|64) \| 0% " /tmp/swap_old.txt /tmp/swap_new.txt /tmp/swap_old2.txt
grep -h "kernels (B 64" /tmp/swap_old.txt /tmp/swap_new.txt | cut -c1-250
grep -E "^ *(batch|  *1 |  *16 )" $L
