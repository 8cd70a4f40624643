"""The Gluon kernel with the index entries loaded one tile ahead of the gathers (prefetch 1), and the softmax's
mask entries too (prefetch 2), against the kernel as it is (0): same bits checked, then timed against FlashMLA
(L2 flushed), both row formats."""
# ruff: noqa: B023, E402, I001, E702, F821
import sys

import torch

sys.path.insert(0, "benchmarks"); sys.path.insert(0, "bench_tmp")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from kernels.fp8_rows import pack_fp8_rows
from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
from kernels.sparse_mla_gluon import sparse_mla_decode_gluon as now
from gluon_pf import sparse_mla_decode_gluon as pf

torch.manual_seed(1)
ok = True
rows = torch.randn(5000, 576, device="cuda")
for fmt, pl in (("bf16", rows.bfloat16()), ("fp8", pack_fp8_rows(rows))):
    for batch, heads, top_k, splits in ((3, 128, 2048, 1), (3, 64, 2048, 4), (5, 128, 1024, 2), (2, 64, 128, 1),
                                        (2, 64, 64, 1)):
        q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        idx = torch.randint(0, 5000, (batch, top_k), device="cuda", dtype=torch.int32)
        idx[0, ::7] = -1
        idx[-1, : top_k // 2] = -1
        base = now(q, pl, idx, SCALE, splits=splits)
        for p in (1, 2):
            got = pf(q, pl, idx, SCALE, splits=splits, prefetch=p)
            same = torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
            ok &= same
            print(f"{fmt} B {batch} H {heads} K {top_k} s {splits}: prefetch {p} same bits: {same}")
del rows
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("| rows | H | B | FlashMLA | now | prefetch 1 | prefetch 2 | FM/now | FM/p1 | FM/p2 |")
for fmt in ("fp8", "bf16"):
    pool = make_pool(fmt)
    for heads, batch in ((128, 64), (128, 128), (64, 64), (128, 16)):
        qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
        fm = bench(lambda i: sparse_mla_decode_flashmla(qs[i], pool, idx[i], SCALE), 2, flush)
        t0 = bench(lambda i: now(qs[i], pool, idx[i], SCALE), 2, flush)
        t1 = bench(lambda i: pf(qs[i], pool, idx[i], SCALE, prefetch=1), 2, flush)
        t2 = bench(lambda i: pf(qs[i], pool, idx[i], SCALE, prefetch=2), 2, flush)
        t0b = bench(lambda i: now(qs[i], pool, idx[i], SCALE), 2, flush)
        print(f"| {fmt} | {heads} | {batch} | {fm:.1f} | {t0:.1f} ({t0b:.1f}) | {t1:.1f} | {t2:.1f} | {fm/t0:.3f} | "
              f"{fm/t1:.3f} | {fm/t2:.3f} |", flush=True)
    del pool
print("ALL CHECKS", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
