# ruff: noqa  -- kept as it ran (from bench_tmp/, run by call2.sh)
"""What slows main-stream kernels beside the side copy: SM share, or the host reads themselves?
Main kernels (tiny RMSNorm, a 256 MB HBM copy, a weight-bound bf16 GEMM) timed alone and beside side work on
8 blocks (or the full grid): spinning blocks (SMs held, no memory), gathers of random 656 B rows from pinned host
memory (the side copy), the same gather from HBM. Prints µs a call and the ratio to alone."""
import torch
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
hbm = torch.ones(64 << 20, dtype=torch.uint8, device=dev)
rows = torch.zeros(1, dtype=torch.int32, device=dev)
dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
from kernels.fp8_gemm import fp8_linear  # noqa: E402

x = torch.randn(44, 6144, dtype=torch.bfloat16, device=dev)
w = torch.randn(16384, 6144, dtype=torch.bfloat16, device=dev)
x2 = torch.randn(44, 16384, dtype=torch.bfloat16, device=dev)
w8 = torch.randn(6144, 16384, device=dev).to(torch.float8_e4m3fn)
s8 = torch.rand(6144 // 128, 16384 // 128, device=dev) * 1e-2 + 1e-3
x3 = torch.randn(44, 6144, dtype=torch.bfloat16, device=dev)
w83 = torch.randn(16384, 6144, device=dev).to(torch.float8_e4m3fn)
s83 = torch.rand(16384 // 128, 6144 // 128, device=dev) * 1e-2 + 1e-3
mains = {
    "bf16 gemm 44x6144x16384": (lambda: x @ w.t(), 40),
    "fp8 44x16384->6144": (lambda: fp8_linear(x2, w8, s8), 60),
    "fp8 44x6144->16384": (lambda: fp8_linear(x3, w83, s83), 60),
}
side_stream = torch.cuda.Stream()


def side_work(blocks):
    if blocks:
        with torch.cuda.stream(side_stream):
            ext.side(hbm, dst, rows, blocks, 0, int(1.98e9 * 0.006))


def timed(fn, calls, blocks):
    torch.cuda.synchronize()
    side_work(blocks)
    torch.cuda._sleep(20000)
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(calls):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / calls


for name, (fn, calls) in mains.items():
    for _ in range(3):
        fn()
    base = None
    for blocks in [0, 1, 2, 4, 8, 16, 32]:
        us = sorted(timed(fn, calls, blocks) for _ in range(5))[2]
        base = base or us
        print(f"{name:24s} spin blocks {blocks:3d} {us:9.2f} us/call  x{us / base:5.2f}")
