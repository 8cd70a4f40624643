# ruff: noqa  -- kept as it ran
"""Micro-benchmark: gathering 656 B / 1152 B rows from pinned host memory into a device pool.

Variants: the engine-style warp copy (int4 loads, one warp a row), the same with the .L2::256B prefetch hint,
and TMA bulk copies (cp.async.bulk global->shared with an mbarrier, then a bulk store shared->global), one row
per thread and S rows in flight per thread. Random rows (the swap-in's pattern) and contiguous rows (ceiling).
"""
import json
import os
import statistics
import sys

import torch
from torch.utils.cpp_extension import load_inline

CUDA = r'''
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <c10/cuda/CUDAStream.h>
#include <cstdint>

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int kChunksPerLane, int kHint>
__global__ void __launch_bounds__(256) warp_copy(const int32_t* __restrict__ src_idx,
    const int32_t* __restrict__ dst_idx, const uint8_t* host, uint8_t* dev, int64_t pitch, int n, int chunks) {
  const int lane = threadIdx.x & 31;
  const int warps = gridDim.x * 8;
  for (int g = blockIdx.x * 8 + (threadIdx.x >> 5); g < n; g += warps) {
    const int4* s = reinterpret_cast<const int4*>(host + (int64_t)src_idx[g] * pitch);
    int4* d = reinterpret_cast<int4*>(dev + (int64_t)dst_idx[g] * pitch);
    int4 buf[kChunksPerLane];
#pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c) {
      const int idx = lane + c * 32;
      if (idx < chunks) {
        if (kHint == 0) {
          buf[c] = __ldg(s + idx);
        } else {
          asm volatile("ld.global.nc.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                       : "=r"(buf[c].x), "=r"(buf[c].y), "=r"(buf[c].z), "=r"(buf[c].w) : "l"(s + idx));
        }
      }
    }
#pragma unroll
    for (int c = 0; c < kChunksPerLane; ++c) {
      const int idx = lane + c * 32;
      if (idx < chunks) d[idx] = buf[c];
    }
  }
}

template <int S>
__global__ void tma_copy(const int32_t* __restrict__ src_idx, const int32_t* __restrict__ dst_idx,
    const uint8_t* host, uint8_t* dev, int64_t pitch, int n, int row_bytes) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x;
  uint8_t* mine = smem + static_cast<size_t>(tid) * S * row_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(blockDim.x) * S * row_bytes) + tid * S;
#pragma unroll
  for (int s = 0; s < S; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int stride = gridDim.x * blockDim.x;
  int g = blockIdx.x * blockDim.x + tid;
  int gs[S];
  uint32_t phase[S];
#pragma unroll
  for (int s = 0; s < S; ++s) {
    gs[s] = g;
    phase[s] = 0;
    if (g < n) {
      const uint32_t bar = smem_u32(bars + s);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(row_bytes) : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   :: "r"(smem_u32(mine + s * row_bytes)), "l"(host + (int64_t)src_idx[g] * pitch), "r"(row_bytes),
                      "r"(bar) : "memory");
    }
    g += stride;
  }
  for (int it = 0;; ++it) {
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const int cur = gs[s];
      if (cur >= n) goto done;
      const uint32_t bar = smem_u32(bars + s);
      uint32_t ok = 0;
      while (!ok) {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(ok) : "r"(bar), "r"(phase[s]) : "memory");
      }
      phase[s] ^= 1;
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(dev + (int64_t)dst_idx[cur] * pitch), "r"(smem_u32(mine + s * row_bytes)), "r"(row_bytes)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      gs[s] = g;
      if (g < n) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(bar), "r"(row_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_u32(mine + s * row_bytes)), "l"(host + (int64_t)src_idx[g] * pitch),
                        "r"(row_bytes), "r"(bar) : "memory");
      }
      g += stride;
    }
  }
done:
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

void run_warp(torch::Tensor src_idx, torch::Tensor dst_idx, torch::Tensor host, torch::Tensor dev, int64_t blocks,
              int64_t hint) {
  const int n = src_idx.numel();
  const int64_t pitch = host.stride(0);
  const int chunks = static_cast<int>(host.size(1) / 16);
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint8_t* h = static_cast<const uint8_t*>(host.data_ptr());
  if (chunks <= 64) {
    if (hint) warp_copy<2, 1><<<blocks, 256, 0, stream>>>(src_idx.data_ptr<int32_t>(), dst_idx.data_ptr<int32_t>(), h, dev.data_ptr<uint8_t>(), pitch, n, chunks);
    else warp_copy<2, 0><<<blocks, 256, 0, stream>>>(src_idx.data_ptr<int32_t>(), dst_idx.data_ptr<int32_t>(), h, dev.data_ptr<uint8_t>(), pitch, n, chunks);
  } else {
    if (hint) warp_copy<3, 1><<<blocks, 256, 0, stream>>>(src_idx.data_ptr<int32_t>(), dst_idx.data_ptr<int32_t>(), h, dev.data_ptr<uint8_t>(), pitch, n, chunks);
    else warp_copy<3, 0><<<blocks, 256, 0, stream>>>(src_idx.data_ptr<int32_t>(), dst_idx.data_ptr<int32_t>(), h, dev.data_ptr<uint8_t>(), pitch, n, chunks);
  }
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "warp launch");
}

void run_tma(torch::Tensor src_idx, torch::Tensor dst_idx, torch::Tensor host, torch::Tensor dev, int64_t blocks,
             int64_t threads, int64_t slots) {
  const int n = src_idx.numel();
  const int64_t pitch = host.stride(0);
  const int row_bytes = static_cast<int>(host.size(1));
  const size_t smem = static_cast<size_t>(threads) * slots * row_bytes + threads * slots * 8;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const uint8_t* h = static_cast<const uint8_t*>(host.data_ptr());
#define LAUNCH(SS) { auto k = tma_copy<SS>; \
    TORCH_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) == cudaSuccess, "attr"); \
    k<<<blocks, threads, smem, stream>>>(src_idx.data_ptr<int32_t>(), dst_idx.data_ptr<int32_t>(), h, dev.data_ptr<uint8_t>(), pitch, n, row_bytes); }
  if (slots == 1) LAUNCH(1) else if (slots == 2) LAUNCH(2) else if (slots == 4) LAUNCH(4) else TORCH_CHECK(false, "slots");
  TORCH_CHECK(cudaGetLastError() == cudaSuccess, "tma launch");
}
'''
CPP = r'''
void run_warp(torch::Tensor src_idx, torch::Tensor dst_idx, torch::Tensor host, torch::Tensor dev, int64_t blocks, int64_t hint);
void run_tma(torch::Tensor src_idx, torch::Tensor dst_idx, torch::Tensor host, torch::Tensor dev, int64_t blocks, int64_t threads, int64_t slots);
'''


def main() -> None:
    ext = load_inline("tma_copy_ext", CPP, cuda_sources=CUDA, functions=["run_warp", "run_tma"],
                      extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a"], verbose=False)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name} SMs {sms}", flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    big_h = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    big_d = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    results = []

    def timed(fn, before=None, reps=25):
        ts = []
        for i in range(reps + 3):
            flush.sum()
            if before is not None:
                before(i)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(i)
            e.record()
            e.synchronize()
            if i >= 3:
                ts.append(s.elapsed_time(e) * 1e3)
        return statistics.median(ts)

    t_copy = timed(lambda i: big_d.copy_(big_h, non_blocking=True))
    copy_gbs = (256 << 20) / t_copy / 1e3
    print(f"pinned copy_ 256 MiB: {t_copy:.1f} us = {copy_gbs:.1f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    for row_bytes in (656, 1152):
        pool_rows = (656 << 20) // row_bytes
        host = torch.empty((pool_rows, row_bytes), dtype=torch.uint8, pin_memory=True)
        host.view(-1)[:] = torch.randint(0, 256, (pool_rows * row_bytes,), dtype=torch.uint8, generator=gen)
        for batch in (44, 64):
            n = batch * 2048 // 5
            dev_rows = batch * 4096
            pool_d = torch.zeros((dev_rows, row_bytes), dtype=torch.uint8, device=dev)
            sets = [torch.randperm(pool_rows, generator=gen)[:n].to(torch.int32).to(dev) for _ in range(6)]
            seq = [torch.arange(k * n, (k + 1) * n, dtype=torch.int32, device=dev) for k in range(6)]
            dsts = [torch.randperm(dev_rows, generator=gen)[:n].to(torch.int32).to(dev) for _ in range(6)]
            variants = {
                "warp 2xSM": lambda s, d: ext.run_warp(s, d, host, pool_d, 2 * sms, 0),
                "warp 8xSM": lambda s, d: ext.run_warp(s, d, host, pool_d, 8 * sms, 0),
                "warp 2xSM L2::256B": lambda s, d: ext.run_warp(s, d, host, pool_d, 2 * sms, 1),
                "tma T128 S1 2xSM": lambda s, d: ext.run_tma(s, d, host, pool_d, 2 * sms, 128, 1),
                "tma T64 S2 2xSM": lambda s, d: ext.run_tma(s, d, host, pool_d, 2 * sms, 64, 2),
                "tma T32 S4 4xSM": lambda s, d: ext.run_tma(s, d, host, pool_d, 4 * sms, 32, 4),
                "tma T32 S1 1xSM": lambda s, d: ext.run_tma(s, d, host, pool_d, sms, 32, 1),
                "tma T128 S1 16blk": lambda s, d: ext.run_tma(s, d, host, pool_d, 16, 128, 1),
                "tma T64 S4 8blk": lambda s, d: ext.run_tma(s, d, host, pool_d, 8, 64, 4),
                "warp 16blk": lambda s, d: ext.run_warp(s, d, host, pool_d, 16, 0),
            }
            ref = None
            for pattern, srcs in (("random", sets), ("contiguous", seq)):
                for name, fn in variants.items():
                    pool_d.zero_()
                    fn(srcs[0], dsts[0])
                    torch.cuda.synchronize()
                    got = pool_d[dsts[0].long()].cpu()
                    want = host[srcs[0].long().cpu()]
                    ok = bool(torch.equal(got, want))
                    t = timed(lambda i: fn(srcs[i % 6], dsts[i % 6]))
                    gbs = n * row_bytes / t / 1e3
                    r = dict(row_bytes=row_bytes, batch=batch, rows=n, pattern=pattern, variant=name, us=round(t, 1),
                             gbs=round(gbs, 1), of_copy=round(gbs / copy_gbs, 3), exact=ok)
                    results.append(r)
                    print(json.dumps(r), flush=True)
        del host
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "tma_copy.json"), "w") as f:
        json.dump(dict(device=props.name, copy_gbs=copy_gbs, results=results), f, indent=1)
    print(f"\n{'rows':>5} {'B':>3} {'pattern':>10} {'variant':>20} {'us':>8} {'GB/s':>6} {'xcopy':>6} ok")
    for r in results:
        print(f"{r['row_bytes']:>5} {r['batch']:>3} {r['pattern']:>10} {r['variant']:>20} {r['us']:>8} {r['gbs']:>6} "
              f"{r['of_copy']:>6} {r['exact']}")


if __name__ == "__main__":
    sys.exit(main())
