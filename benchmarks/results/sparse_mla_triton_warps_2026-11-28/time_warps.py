"""Prepared (not yet run, 2026-11-28): the Triton sparse MLA kernel at a TP rank's 16 / 32 heads with 8 warps a
program instead of 4 (issue 23 item 6, GPUs without wgmma). Compiled for sm_90 (compile_stats.py), BLOCK_H 32 with 4
warps keeps 672 B of stack for FP8 rows (3589 SASS instructions a tile against 1825 with 8 warps), BLOCK_H 16 with
4 warps 40 B (2281 against 1186). Times the product config (`default_config`) against 8 warps at B 1-256, both row
formats, with each one's error against the float reference; the product picks its split count the same way for both.

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_triton_warps_2026-11-28/time_warps.py
"""
# ruff: noqa: E402, I001
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.sparse_mla_triton import default_config, sparse_mla_decode_triton


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), flush=True)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for fmt in ("fp8", "bf16"):
        pool = make_pool(fmt)
        for heads in (16, 32):
            base = default_config(heads, fmt == "fp8")
            variants = {"product": base, "8 warps": dict(base, num_warps=8)}
            for batch in (1, 16, 64, 128, 256):
                qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
                idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32)
                       for _ in range(2)]
                ref, _ = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
                cells = {}
                for name, cfg in variants.items():
                    out, _ = sparse_mla_decode_triton(qs[0], pool, idx[0], SCALE, cfg)
                    err = float((out.float() - ref.float()).norm() / ref.float().norm())
                    if err > 1e-2:
                        raise SystemExit(f"{fmt} H {heads} B {batch} {name}: error {err:.2e}")
                    us = bench(lambda i, c=cfg, q=qs, ix=idx, kv=pool: sparse_mla_decode_triton(q[i], kv, ix[i], SCALE, c),
                               2, flush)
                    cells[name] = (us, err)
                rows.append((fmt, heads, batch, cells))
                print(fmt, heads, batch, {k: f"{v[0]:.1f} us err {v[1]:.1e}" for k, v in cells.items()}, flush=True)
        pool = None
        torch.cuda.empty_cache()
    print("| rows | H | B | product (4 warps) µs | 8 warps µs | product / 8 warps |")
    print("|---|---|---|---|---|---|")
    for fmt, heads, batch, cells in rows:
        a, b = cells["product"][0], cells["8 warps"][0]
        print(f"| {fmt} | {heads} | {batch} | {a:.1f} | {b:.1f} | {a / b:.3f} |")
    print("ALL CHECKS PASS")


if __name__ == "__main__":
    main()
