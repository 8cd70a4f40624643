"""FP8 rows: the Gluon kernel with the next tile's dequantization beside the PV (overlap_dequant) or before the
scores; checked against the reference, then timed against FlashMLA (128 and 64 heads, K 2048). It ran against the
kernel while it had the `overlap_dequant` argument (dropped afterwards: no gain on the H100), so it no longer runs
as it is; a record of calls 3 and 4 (README.md). The lambdas run before the loop variables change."""
# ruff: noqa: B023, E402, I001
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.fp8_rows import pack_fp8_rows
from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
from kernels.sparse_mla_gluon import sparse_mla_decode_gluon

torch.manual_seed(1)
rows = torch.randn(5000, 576, device="cuda")
pool = pack_fp8_rows(rows)
ok = True
for batch, heads, top_k, splits in ((3, 128, 2048, 1), (3, 64, 2048, 4), (5, 128, 1024, 2), (1, 64, 128, 2)):
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    idx = torch.randint(0, 5000, (batch, top_k), device="cuda", dtype=torch.int32)
    idx[0, ::7] = -1
    if batch > 2:
        idx[2] = -1
    ref, ref_lse = sparse_mla_decode_rows_ref(q, pool, idx, SCALE)
    outs = {}
    for ov in (False, True):
        out, lse = sparse_mla_decode_gluon(q, pool, idx, SCALE, splits=splits, overlap_dequant=ov)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        fin = torch.isfinite(ref_lse)
        lerr = float((lse[fin] - ref_lse[fin]).abs().max())
        good = err < 1e-2 and lerr < 1e-3 and bool(torch.isfinite(out).all())
        ok &= good
        outs[ov] = (out, lse)
        print(f"overlap {ov} B {batch} H {heads} K {top_k} s {splits}: err {err:.2e} lse {lerr:.1e} {'ok' if good else 'WRONG'}")
    print("  same bits both ways:", torch.equal(outs[False][0], outs[True][0]) and torch.equal(outs[False][1], outs[True][1]))
del pool, rows
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
pool = make_pool("fp8")
print("| H | B | FlashMLA | gluon | gluon overlap | ratio | ratio overlap |")
for heads in (128, 64):
    for batch in (16, 64, 128):
        qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
        fm = bench(lambda i: sparse_mla_decode_flashmla(qs[i], pool, idx[i], SCALE), 2, flush)
        g0 = bench(lambda i: sparse_mla_decode_gluon(qs[i], pool, idx[i], SCALE), 2, flush)
        g1 = bench(lambda i: sparse_mla_decode_gluon(qs[i], pool, idx[i], SCALE, overlap_dequant=True), 2, flush)
        g1s = bench(lambda i: sparse_mla_decode_gluon(qs[i], pool, idx[i], SCALE, splits=1, overlap_dequant=True), 2, flush)
        g0s = bench(lambda i: sparse_mla_decode_gluon(qs[i], pool, idx[i], SCALE, splits=1), 2, flush)
        print(f"| {heads} | {batch} | {fm:.1f} | {g0:.1f} | {g1:.1f} | {fm/g0:.3f} | {fm/g1:.3f} | 1 split: {g0s:.1f} {g1s:.1f}", flush=True)
sys.exit(0 if ok else 1)
