set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD HISPARSE_KERNEL_CACHE=/tmp/kc TRITON_CACHE_DIR=/tmp/triton CXX=/usr/bin/g++ MAX_JOBS=8
nvidia-smi -L; mkdir -p /tmp/sgl_build
(timeout 200 python3 bench_tmp/sgl_build.py > $OUT/sgl_build.log 2>&1; echo "sgl build rc $?" >> $OUT/sgl_build.log) &
python3 -c "
import torch; from kernels.topk_cuda import topk_positions_cuda
topk_positions_cuda(torch.randn(2, 8192, device='cuda'), torch.full((2,), 8192, device='cuda'), 2048); print('ours built', flush=True)"
wait
tail -3 $OUT/sgl_build.log
timeout 200 python3 bench_tmp/topk_anchor.py 2>&1 | tee $OUT/topk_anchor.log | grep -v "^{" | tail -25
