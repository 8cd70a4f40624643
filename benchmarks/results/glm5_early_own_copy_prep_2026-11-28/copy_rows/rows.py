# ruff: noqa  -- kept as it ran
"""Swap-in copy, 20 % misses, D 4096, K 2048: µs and GB/s per (rows, batch, cap) for this process's kernel."""
import sys, os
sys.path.insert(0, "benchmarks")
import torch
from bench_swap_in import random_pinned, setup_case
from _timing import pinned_h2d_gbps, time_gpu_us

tag = os.environ.get("TAG", "?")
peak = pinned_h2d_gbps(256 << 20)
for row in (656, 1152):
    dev_pool = torch.empty((1 << 19, row), dtype=torch.uint8, device="cuda")
    host = random_pinned(1 << 20, row)
    for batch in (16, 44, 64):
        for cap in (0, 8):
            call, reset, n_miss = setup_case(host, dev_pool, batch, 4096, 2048, 0.2, max_copy_blocks=cap)
            us = time_gpu_us(call, reset=reset)
            gbps = batch * n_miss * row / us / 1e3
            print(f"ROW {tag} row {row} B {batch} cap {cap}: {us:.1f} us {gbps:.1f} GB/s {gbps/peak:.3f} of {peak:.1f}", flush=True)
    del host, dev_pool
