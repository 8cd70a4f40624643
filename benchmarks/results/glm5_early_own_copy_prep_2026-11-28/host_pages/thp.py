# ruff: noqa  -- kept as it ran
"""Swap-in copy rate (20 % misses, D 4096, K 2048) by how the host pool is allocated: torch pinned (cudaHostAlloc),
the product's host_empty (mmap + cudaHostRegister, 4 KiB pages unless THP is 'always'), the same with
MADV_HUGEPAGE (2 MiB pages), and a pool whose rows all lie in 10 MiB (locality)."""
import mmap, sys, os
sys.path.insert(0, "benchmarks")
import torch
from bench_swap_in import setup_case
from _timing import pinned_h2d_gbps, time_gpu_us
from decode_server.engine import pinned

for f in ("enabled", "defrag"):
    try:
        print(f"THP {f}:", open(f"/sys/kernel/mm/transparent_hugepage/{f}").read().strip())
    except OSError as e:
        print("THP", f, e)
print([l.strip() for l in open("/proc/meminfo") if "Huge" in l])
peak = pinned_h2d_gbps(256 << 20)
print(f"pinned copy {peak:.1f} GB/s", flush=True)
ROWS = 1 << 20
dev = torch.device("cuda")

def fill(host):
    chunk = 1 << 16
    for s in range(0, host.shape[0], chunk):
        part = torch.randint(0, 255, (min(chunk, host.shape[0] - s), host.shape[1]), dtype=torch.uint8, device="cuda")
        host[s:s + part.shape[0]].copy_(part)
    torch.cuda.synchronize()

def anon_huge_kb():
    for l in open("/proc/self/smaps_rollup"):
        if l.startswith("AnonHugePages"):
            return int(l.split()[1])
    return -1

def make(kind, row):
    n = ROWS * row
    if kind == "torch_pinned":
        h = torch.empty((ROWS, row), dtype=torch.uint8, pin_memory=True)
    elif kind == "host_empty":
        h = pinned.host_empty((ROWS, row), torch.uint8, dev, "bench")
    else:  # thp
        length = -(-n // (2 << 20)) * (2 << 20) + (2 << 20)
        m = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m.madvise(mmap.MADV_HUGEPAGE)
        h = pinned.lock_mapping(m, n, dev, "bench-thp", prefault=True).view(ROWS, row)
    fill(h)
    return h

res = []
for row in (656, 1152):
    dev_pool = torch.empty((1 << 19, row), dtype=torch.uint8, device="cuda")
    for kind in ("torch_pinned", "host_empty", "thp", "torch_pinned"):
        before = anon_huge_kb()
        h = make(kind, row)
        huge = anon_huge_kb() - before
        for span, pool in (("1M rows", h), ("16K rows", h[:16384])):
            if span == "16K rows" and kind != "torch_pinned":
                continue
            for batch in (44, 64):
                for cap in (0, 8):
                    call, reset, n_miss = setup_case(pool, dev_pool, batch, 4096, 2048, 0.2, max_copy_blocks=cap)
                    us = time_gpu_us(call, reset=reset)
                    g = batch * n_miss * row / us / 1e3
                    res.append((row, kind, span, batch, cap, us, g, g / peak, huge // 1024))
                    print("R %4d %-12s %-8s B %2d cap %d %7.1f us %5.1f GB/s %.3f (AnonHuge +%d MiB)" % res[-1], flush=True)
        del h
        pinned.release_unused()
    del dev_pool
