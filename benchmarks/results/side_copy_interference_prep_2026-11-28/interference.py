"""Prepared (not yet run): what slows the main stream's kernels beside the GLM-5 prefetch's side-stream copy
(issue 23 item 3: the MoE's grouped GEMMs 75 -> 98 µs and FlashMLA's combine 7 -> 27 µs beside the followers'
copies, "The GLM-5 prefetch's floor" in docs/benchmarks-history.md). Each main-stream kernel is timed alone and
while one "occupier" runs on a high-priority side stream, started first and lasting longer than it:

  swapin-16 / swapin-8   the real swap-in (FP8 656 B rows, B 64, D 4096, K 2048, 20 % misses; zero-copy host
                         reads) with its copy grid capped at 16 / 8 blocks, as the prefetch runs it
  spin-16 / spin-8       16 / 8 blocks of 8 warps doing arithmetic only: SMs taken, no memory traffic
  hbm-16                 16 blocks streaming a device-to-device copy: SMs taken plus HBM traffic, no PCIe

Main-stream kernels: our attention at GLM-5's shape (FP8 rows, 64 heads, B 64; the dispatcher's kernel, Gluon on
Hopper), FlashMLA at the same shape (if installed), a bf16 GEMM [64, 7168] x [7168, 4096] (weight-bound, as the
experts' GEMMs at decode), a 256 MiB device copy (HBM-bound). If spin-N slows a kernel as much as swapin-N, SM
occupancy is the cause (main kernels sized to every SM run a partial second wave); if hbm-16 or only swapin-N
does, memory-side contention (the host reads' long-lived requests) is.

    PYTHONPATH=$PWD python3 benchmarks/results/side_copy_interference_prep_2026-11-28/interference.py
"""
# ruff: noqa: B023, E402, I001
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import SCALE
from bench_swap_in import HOST_ROWS, NUM_RECENT, random_pinned, setup_case
from kernels.dispatch import sparse_mla_decode
from kernels.fp8_rows import pack_fp8_rows

try:
    from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
except ImportError:
    sparse_mla_decode_flashmla = None


@triton.jit
def _spin_kernel(out_ptr, n_iter):
    """Arithmetic only: holds an SM slot (8 warps) for n_iter iterations, no memory traffic until the end."""
    acc = tl.zeros([1024], tl.float32) + tl.program_id(0).to(tl.float32)
    for _ in range(0, n_iter):
        acc = acc * 0.999999 + 0.5
    tl.store(out_ptr + tl.program_id(0) * 1024 + tl.arange(0, 1024), acc)


@triton.jit
def _stream_kernel(src_ptr, dst_ptr, per_prog, rounds, BLOCK: tl.constexpr):
    """Device-to-device copy of this program's slice, `rounds` times: HBM traffic from a fixed set of SMs."""
    base = tl.program_id(0).to(tl.int64) * per_prog
    offs = tl.arange(0, BLOCK)
    for _ in range(0, rounds):
        for off in range(0, per_prog, BLOCK):
            tl.store(dst_ptr + base + off + offs, tl.load(src_ptr + base + off + offs))


def median_us(fn, occupier=None, reset=None, iters: int = 15) -> float:
    """Median µs of fn on the main stream, alone or with `occupier` launched first on a high-priority side stream
    (it must outlast fn; a 20 µs spin on the main stream lets its blocks become resident first)."""
    main = torch.cuda.current_stream()
    side = median_us.side
    times = []
    for i in range(iters + 3):
        if reset is not None:
            reset()
        torch.cuda._sleep(50_000)
        if occupier is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                occupier()
            torch.cuda._sleep(40_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if occupier is not None:
            main.wait_stream(side)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    median_us.side = torch.cuda.Stream(priority=-1)
    print(torch.cuda.get_device_name(), flush=True)
    # Occupiers.
    host_pool = random_pinned(HOST_ROWS, 656)
    batch, buffer_size, top_k = 64, 4096, 2048
    device_pool = torch.empty((batch * (buffer_size + NUM_RECENT) + 64, 656), dtype=torch.uint8, device=dev)
    swaps = {cap: setup_case(host_pool, device_pool, batch, buffer_size, top_k, 0.2, max_copy_blocks=cap)
             for cap in (16, 8)}
    spin_out = torch.empty(64 * 1024, dtype=torch.float32, device=dev)
    n_iter = 100_000
    t = median_us(lambda: _spin_kernel[(16,)](spin_out, n_iter, num_warps=8))
    n_iter = max(1000, int(n_iter * 600.0 / t))  # ~600 µs
    src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    per_prog = (1 << 28) // 16
    t = median_us(lambda: _stream_kernel[(16,)](src, dst, per_prog, 1, BLOCK=4096, num_warps=8))
    rounds = max(1, round(600.0 / t))
    occupiers = {
        "swapin-16": (swaps[16][0], swaps[16][1]),
        "swapin-8": (swaps[8][0], swaps[8][1]),
        "spin-16": (lambda: _spin_kernel[(16,)](spin_out, n_iter, num_warps=8), None),
        "spin-8": (lambda: _spin_kernel[(8,)](spin_out, n_iter, num_warps=8), None),
        "hbm-16": (lambda: _stream_kernel[(16,)](src, dst, per_prog, rounds, BLOCK=4096, num_warps=8), None),
    }
    for name, (occ, reset) in occupiers.items():
        print(f"occupier {name}: {median_us(occ, reset=reset):.0f} µs alone", flush=True)
    # Main-stream kernels.
    pool = pack_fp8_rows(torch.randn(1 << 18, 576, device=dev))
    q = torch.randn(64, 64, 576, device=dev).bfloat16()
    idx = torch.randint(0, pool.shape[0], (64, 2048), device=dev, dtype=torch.int32)
    x = torch.randn(64, 7168, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4096, 7168, dtype=torch.bfloat16, device=dev)
    big_src = torch.empty(1 << 28, dtype=torch.uint8, device=dev)
    big_dst = torch.empty_like(big_src)
    kernels = {"attention (ours) FP8 H64 B64": lambda: sparse_mla_decode(q, pool, idx, SCALE),
               "GEMM bf16 64x7168x4096": lambda: torch.mm(x, w.t()),
               "device copy 256 MiB": lambda: big_dst.copy_(big_src)}
    if sparse_mla_decode_flashmla is not None:
        kernels["FlashMLA FP8 H64 B64"] = lambda: sparse_mla_decode_flashmla(q, pool, idx, SCALE)
    print("| main kernel | alone µs | " + " | ".join(occupiers) + " |")
    for name, fn in kernels.items():
        alone = median_us(fn)
        cells = []
        for occ, reset in occupiers.values():
            with_occ = median_us(fn, occ, reset)
            cells.append(f"{with_occ:.1f} ({with_occ / alone:.2f}×)")
        print(f"| {name} | {alone:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
