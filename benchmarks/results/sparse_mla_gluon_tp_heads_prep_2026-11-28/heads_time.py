"""Prepared (not yet run): TP ranks' head counts (16, 32) through the Gluon kernel padded to one 64-head program
(`gluon_heads.py`) against the Triton kernel they run now (BLOCK_H = 16 / 32, mma.sync): checked against the
reference (NaN-free pools, skipped entries, 1 and 4 splits), then timed (L2 flushed) with the memory floor of the
same call (the selected rows' bytes at the bandwidth of a device-to-device copy)."""
# ruff: noqa: B023, E402, I001
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from gluon_heads import sparse_mla_decode_gluon as padded
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.fp8_rows import pack_fp8_rows
from kernels.sparse_mla_triton import sparse_mla_decode_triton as triton_kernel

torch.manual_seed(1)
ok = True
rows = torch.randn(5000, 576, device="cuda")
for fmt, pl in (("bf16", rows.bfloat16()), ("fp8", pack_fp8_rows(rows))):
    for batch, heads, top_k, splits in ((3, 16, 2048, 1), (3, 16, 2048, 4), (5, 32, 1024, 2), (2, 16, 64, 1),
                                        (4, 128, 2048, 1)):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        idx = torch.randint(0, 5000, (batch, top_k), device="cuda", dtype=torch.int32)
        idx[0, ::7] = -1
        idx[-1] = -1
        ref, ref_lse = sparse_mla_decode_rows_ref(q, pl, idx, SCALE)
        out, lse = padded(q, pl, idx, SCALE, splits=splits)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        fin = torch.isfinite(ref_lse)
        good = (err < 1e-2 and bool((lse[fin] - ref_lse[fin]).abs().max() < 1e-3)
                and bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))) and bool(torch.isfinite(out).all()))
        ok &= good
        print(f"{fmt} B {batch} H {heads} K {top_k} s {splits}: err {err:.2e} {'ok' if good else 'WRONG'}")
del rows
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
copy_us = bench(lambda i: dst.copy_(src), 1, flush)
copy_gbps = 2 * src.numel() / copy_us / 1e3
src = dst = None
print(f"device copy: {copy_gbps:.0f} GB/s")
print("| rows | H | B | floor µs | Triton µs | Gluon padded µs | Triton/Gluon | floor/Gluon |")
for fmt in ("fp8", "bf16"):
    pool = make_pool(fmt)
    row_bytes = 656 if fmt == "fp8" else 1152
    for heads in (16, 32):
        for batch in (16, 64, 128, 256):
            qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
            idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
            floor = batch * 2048 * row_bytes / copy_gbps / 1e3
            tt = bench(lambda i: triton_kernel(qs[i], pool, idx[i], SCALE), 2, flush)
            tg = bench(lambda i: padded(qs[i], pool, idx[i], SCALE), 2, flush)
            print(f"| {fmt} | {heads} | {batch} | {floor:.1f} | {tt:.1f} | {tg:.1f} | {tt / tg:.3f} | "
                  f"{floor / tg:.3f} |", flush=True)
    pool = None
print("ALL CHECKS", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
