# ruff: noqa  -- kept as it ran on the device (2026-11-27, session 20), a one-off experiment
"""How fast can any kernel read N bytes once at the indexer's sizes? torch.sum against Triton streaming reads with
several grid sizes, timed like bench_indexer.py (events after an L2-flushing read; and in a replayed graph)."""
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "benchmarks")
from _timing import time_gpu_us  # noqa: E402


@triton.jit
def _read_kernel(x_ptr, out_ptr, n_vec, per_prog, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    start = pid * per_prog
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in range(start, start + per_prog, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n_vec, other=0, cache_modifier=".cg")
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda").view(torch.int64)
flush_sink = torch.zeros((), dtype=torch.int64, device="cuda")


def flush_read():
    torch.sum(flush, dim=0, out=flush_sink)


def graph_us(fn, pairs=16, replays=15):
    fn(); torch.cuda.synchronize()
    gs = []
    for with_fn in (True, False):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(pairs):
                flush_read()
                if with_fn:
                    fn()
        g.replay(); gs.append(g)
    torch.cuda.synchronize()
    t = [[], []]
    for _ in range(replays):
        for g, out in zip(gs, t):
            torch.cuda._sleep(1_000_000)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); g.replay(); b.record(); b.synchronize()
            out.append(a.elapsed_time(b) * 1000)
    return (statistics.median(t[0]) - statistics.median(t[1])) / pairs


src = torch.ones(1 << 29, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
copy_us = time_gpu_us(lambda: dst.copy_(src), iters=10)
copy = 2 * src.numel() / copy_us / 1e3
big = torch.ones(2 << 30, dtype=torch.uint8, device="cuda")
big_sink = torch.zeros((), dtype=torch.int64, device="cuda")
big_read = big.numel() / time_gpu_us(lambda: torch.sum(big.view(torch.int64), dim=0, out=big_sink), iters=10) / 1e3
del dst, src, big
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"{torch.cuda.get_device_name()}: copy 1 GiB {copy:.0f} GB/s, read 2 GiB (torch.sum) {big_read:.0f} GB/s, {sms} SMs")
rows = []
for label, nbytes in (("B16 32K", 16 * 32768 * 140), ("B16 64K", 16 * 65536 * 140), ("B64 32K", 64 * 32768 * 140)):
    words = torch.ones(nbytes // 8, dtype=torch.int64, device="cuda")
    sink = torch.zeros((), dtype=torch.int64, device="cuda")
    cands = [("torch.sum", lambda: torch.sum(words, dim=0, out=sink))]
    vec = words.view(torch.int32)
    n_vec = vec.numel()
    out = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    for per_sm in (1, 2, 4, 8, 16):
        for block, warps in ((2048, 4), (4096, 8), (8192, 8)):
            progs = per_sm * sms
            per_prog = triton.cdiv(triton.cdiv(n_vec, progs), block) * block
            progs = triton.cdiv(n_vec, per_prog)

            def fn(progs=progs, per_prog=per_prog, block=block, warps=warps):
                _read_kernel[(progs,)](vec, out, n_vec, per_prog, BLOCK=block, num_warps=warps)

            cands.append((f"triton {per_sm}/SM B{block} w{warps}", fn))
    for name, fn in cands:
        ev = time_gpu_us(fn, reset=flush_read)
        gr = graph_us(fn)
        rows.append((label, name, ev, nbytes / ev / 1e3 / copy, gr, nbytes / gr / 1e3 / copy))
    del words
for label in dict.fromkeys(r[0] for r in rows):
    sub = sorted([r for r in rows if r[0] == label], key=lambda r: r[4])
    base = [r for r in sub if r[1] == "torch.sum"][0]
    print(f"\n{label}: torch.sum events {base[2]:.1f} us {base[3]:.1%}, graph {base[4]:.1f} us {base[5]:.1%}")
    for r in sub[:6]:
        print(f"  {r[1]:28s} events {r[2]:6.1f} us {r[3]:6.1%}   graph {r[4]:6.1f} us {r[5]:6.1%}")
