# ruff: noqa  -- kept as it ran
"""Swap-in copy of 656 B rows from host pools of pitch 656 / 672 / 704 / 768 B (aligned 16 / 32 / 64 / 128 B)."""
import sys, json
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from bench_swap_in import random_pinned, run_case, setup_case
from _timing import pinned_h2d_gbps, time_gpu_us

peak = pinned_h2d_gbps(256 << 20)
print(f"pinned copy {peak:.1f} GB/s", flush=True)
dev_pool = torch.empty((1 << 19, 656), dtype=torch.uint8, device="cuda")
rows = []
for pitch in (656, 672, 704, 768, 656):
    host = random_pinned(1 << 20, pitch)[:, :656]
    for batch in (16, 44, 64):
        for cap in (0, 8):
            call, reset, n_miss = setup_case(host, dev_pool, batch, 4096, 2048, 0.2, max_copy_blocks=cap)
            us = time_gpu_us(call, reset=reset)
            gbps = batch * n_miss * 656 / us / 1e3
            rows.append((pitch, batch, cap, us, gbps, gbps / peak))
            print(f"pitch {pitch} B {batch} cap {cap}: {us:.1f} us {gbps:.1f} GB/s {gbps/peak:.3f}", flush=True)
    del host
print("pitch batch cap us GB/s frac")
for r in rows:
    print("%4d %3d %2d %8.1f %6.1f %.3f" % r)
