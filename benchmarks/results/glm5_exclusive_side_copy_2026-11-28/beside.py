# ruff: noqa  -- kept as it ran (from bench_tmp/, run by call2.sh: PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/tmp/te python3 beside.py)
"""What slows main-stream kernels beside the side copy: SM share, or the host reads themselves?
Main kernels (tiny RMSNorm, a 256 MB HBM copy, a weight-bound bf16 GEMM) timed alone and beside side work on
8 blocks (or the full grid): spinning blocks (SMs held, no memory), gathers of random 656 B rows from pinned host
memory (the side copy), the same gather from HBM. Prints µs a call and the ratio to alone."""
import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
__global__ void side_kernel(const int4* __restrict__ src, int4* __restrict__ dst, const int* __restrict__ rows,
                            long n_rows, int mode, long long spin_ns) {
  const int lane = threadIdx.x & 31;
  const long warp = (blockIdx.x * (long)blockDim.x + threadIdx.x) >> 5;
  const long warps = (gridDim.x * (long)blockDim.x) >> 5;
  if (mode == 0) {
    if (threadIdx.x == 0) { long long t0 = clock64(); while (clock64() - t0 < spin_ns) {} }
    __syncthreads();
    return;
  }
  // 41 int4 per 656 B row; 4 rows a warp in flight
  for (long g = warp * 4; g < n_rows; g += warps * 4) {
    int4 buf[4][2];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      long row = g + r < n_rows ? rows[g + r] : -1;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        int idx = lane + 32 * c;
        if (row >= 0 && idx < 41) buf[r][c] = __ldg(src + row * 41 + idx);
      }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        int idx = lane + 32 * c;
        if (g + r < n_rows && idx < 41) dst[(g + r) * 41 + idx] = buf[r][c];
      }
    }
  }
}
void side(torch::Tensor src, torch::Tensor dst, torch::Tensor rows, int64_t blocks, int64_t mode, int64_t spin) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int4* s = reinterpret_cast<const int4*>(src.data_ptr());
  side_kernel<<<blocks, 256, 0, stream>>>(s, reinterpret_cast<int4*>(dst.data_ptr()), rows.data_ptr<int>(),
                                         rows.numel(), (int)mode, (long long)spin);
}
"""
ext = load_inline("beside_ext", cpp_sources="void side(torch::Tensor src, torch::Tensor dst, torch::Tensor rows, int64_t blocks, int64_t mode, int64_t spin);",
                  cuda_sources=SRC, functions=["side"], extra_cuda_cflags=["-O3", "-arch=sm_90a"], verbose=False)

dev = torch.device("cuda")
POOL_ROWS = 1_000_000  # 656 MB
host = torch.empty(POOL_ROWS * 656, dtype=torch.uint8, pin_memory=True)
host.fill_(1)
hbm = torch.ones(POOL_ROWS * 656, dtype=torch.uint8, device=dev)
n_rows = 400_000  # ~262 MB: ~5 ms at 50 GB/s
rows = torch.randint(0, POOL_ROWS, (n_rows,), dtype=torch.int32, device=dev)
dst = torch.empty(n_rows * 656, dtype=torch.uint8, device=dev)

x = torch.randn(44, 6144, dtype=torch.bfloat16, device=dev)
nw = torch.ones(6144, dtype=torch.bfloat16, device=dev)
big_a = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
big_b = torch.empty_like(big_a)
w = torch.randn(16384, 6144, dtype=torch.bfloat16, device=dev)
mains = {
    "rmsnorm 44x6144": (lambda: F.rms_norm(x, (6144,), nw), 400),
    "copy 256MB": (lambda: big_b.copy_(big_a), 8),
    "gemm 44x6144x16384": (lambda: x @ w.t(), 40),
}
side_stream = torch.cuda.Stream()
sms = torch.cuda.get_device_properties(0).multi_processor_count


def side_work(mode: str):
    if mode == "none":
        return
    kind, blocks = mode.split("@")
    blocks = sms * 2 if blocks == "full" else int(blocks)
    with torch.cuda.stream(side_stream):
        if kind == "spin":
            ext.side(hbm, dst, rows, blocks, 0, int(1.98e9 * 0.006))  # ~6 ms at ~1.98 GHz
        else:
            ext.side(host if kind == "host" else hbm, dst, rows[: n_rows if blocks <= 16 else n_rows], blocks, 1, 0)


def timed(fn, calls, mode):
    torch.cuda.synchronize()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side_stream):
        s0.record()
    side_work(mode)
    with torch.cuda.stream(side_stream):
        s1.record()
    torch.cuda._sleep(20000)  # let the side work start first
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / calls, s0.elapsed_time(s1) * 1000


modes = ["none", "spin@8", "host@8", "hbm@8", "host@16", "host@full"]
for name, (fn, calls) in mains.items():
    for _ in range(3):
        fn()
    base = None
    for mode in modes:
        vals = sorted(timed(fn, calls, mode) for _ in range(5))
        us, side_us = vals[2]
        base = base or us
        main_ms = us * calls / 1000
        print(f"{name:20s} {mode:10s} {us:9.2f} us/call  x{us / base:5.2f}  (main {main_ms:5.2f} ms, side {side_us / 1000:6.2f} ms)")
side_stream.synchronize()
for mode in ["host@8", "host@16", "host@full", "hbm@8"]:
    torch.cuda.synchronize()
    _, side_us = timed(lambda: None, 1, mode)
    print(f"side alone {mode:10s} {side_us / 1000:6.2f} ms = {n_rows * 656 / side_us / 1e3:6.1f} GB/s")
