python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo $GPU
if echo "$GPU" | grep -q H200; then CFG=dsv32-rank-ep8; else CFG=dsv32-rank-ep16; fi
# 1. batch 1, dense over the same synthetic selection as HiSparse (dense-m5), 8K / 32K / 64K
timeout 260 python3 benchmarks/bench_decode.py --config $CFG --contexts 8192 32768 65536 --miss-rates 0.05 --batch-sizes --max-batch 1 --skip-model-indexer-run --dense-synthetic-topk --steps 30 --warmup 3 --host-memory-fraction 0.7 --out $OUT/rank_b1_fair.json 2>&1 | grep -v "it/s\]" > $OUT/rank_b1_fair.log
grep -E "^(dense|hisparse)" $OUT/rank_b1_fair.log
# 2. (c) graphs on vs off: the router kernel off, then on again
cat > /tmp/run_c.py <<'PY'
import sys, pytest
from decode_server.model import fused_ops
fused_ops.set_router_enabled(sys.argv[1] == "on")
sys.exit(pytest.main(["-p", "no:cacheprovider", "-o", "addopts=", "-q", "-rfE", "-s", "-m", "gpu",
    "tests/hisparse/test_cuda_graph_gpu.py::test_graphs_on_and_off_give_the_same_tokens"]))
PY
timeout 150 python3 /tmp/run_c.py off > $OUT/c_router_off.log 2>&1; echo "router off: exit $?"
grep -E "^\(c\)|passed|failed|margin" $OUT/c_router_off.log | head -8
timeout 150 python3 /tmp/run_c.py on > $OUT/c_router_on.log 2>&1; echo "router on: exit $?"
grep -E "^\(c\)|passed|failed|margin" $OUT/c_router_on.log | head -8
