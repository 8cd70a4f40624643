"""FP8 rows: the Gluon kernel's dequantization done (0) as now: e4m3 -> f16 -> f32, x scale, -> bf16; (1) with
integer ops: the byte's bits moved into a bf16 (x 2^-120), then two bf16x2 multiplies (2^120, scale); (3) cvt
e4m3x2 -> f16x2, bits moved into a bf16 (x 2^-112), two multiplies; (2) not at all (a bound; wrong results).
Checks 1 and 3 give the same bits as 0 (random rows and rows holding every finite e4m3 byte with extreme scales),
then times all against FlashMLA (L2 flushed)."""
# ruff: noqa: B023, E402, E702, I001
import sys

import torch

sys.path.insert(0, "benchmarks"); sys.path.insert(0, "bench_tmp")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.fp8_rows import pack_fp8_rows
from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
from gluon_dq import sparse_mla_decode_gluon

torch.manual_seed(1)
ok = True
rows = torch.randn(5000, 576, device="cuda")
pool = pack_fp8_rows(rows)
# Rows holding every finite e4m3 byte (0x7f / 0xff are NaN) with scales from 2^-22 to 2^20.
crafted = pool.clone()
finite = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8, device="cuda")
n_craft = 1024
pos = torch.arange(n_craft * 512, device="cuda") % finite.numel()
crafted[:n_craft, :512] = finite[pos].view(n_craft, 512)
exps = torch.randint(-22, 21, (n_craft, 4), device="cuda").float()
crafted[:n_craft, 512:528] = torch.exp2(exps).contiguous().view(torch.uint8)
for name, pl in (("random", pool), ("every byte", crafted)):
    for batch, heads, top_k, splits in ((3, 128, 2048, 1), (3, 64, 2048, 4), (5, 128, 1024, 2)):
        q = (torch.randn(batch, heads, 576, device="cuda") * (1e-3 if name != "random" else 1)).bfloat16()
        hi = n_craft if name != "random" else 5000
        idx = torch.randint(0, hi, (batch, top_k), device="cuda", dtype=torch.int32)
        idx[0, ::7] = -1
        ref = sparse_mla_decode_rows_ref(q, pl, idx, SCALE)
        base = sparse_mla_decode_gluon(q, pl, idx, SCALE, splits=splits, dequant=0)
        if name == "random":
            err = float((base[0].float() - ref[0].float()).norm() / ref[0].float().norm())
            print(f"  v0 vs reference: rel err {err:.2e}")
            ok &= err < 1e-2
        for dq in (1, 3):
            got = sparse_mla_decode_gluon(q, pl, idx, SCALE, splits=splits, dequant=dq)
            same = torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
            nan_same = bool((torch.isnan(got[0]) == torch.isnan(base[0])).all())
            ok &= same
            print(f"{name} B {batch} H {heads} K {top_k} s {splits}: v{dq} same bits as v0: {same} (NaN pattern {nan_same})")
del pool, rows, crafted
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
pool = make_pool("fp8")
print("| H | B | FlashMLA | v0 now | v1 int | v3 f16 | v2 none | FM/v0 | FM/v1 | FM/v3 | FM/v2 |")
for heads, batch in ((128, 64), (128, 128), (64, 64), (128, 16), (64, 128)):
    qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
    idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
    fm = bench(lambda i: sparse_mla_decode_flashmla(qs[i], pool, idx[i], SCALE), 2, flush)
    t = {dq: bench(lambda i: sparse_mla_decode_gluon(qs[i], pool, idx[i], SCALE, dequant=dq), 2, flush)
         for dq in (0, 1, 3, 2)}
    fm2 = bench(lambda i: sparse_mla_decode_flashmla(qs[i], pool, idx[i], SCALE), 2, flush)
    print(f"| {heads} | {batch} | {fm:.1f} ({fm2:.1f}) | {t[0]:.1f} | {t[1]:.1f} | {t[3]:.1f} | {t[2]:.1f} | "
          f"{fm/t[0]:.3f} | {fm/t[1]:.3f} | {fm/t[3]:.3f} | {fm/t[2]:.3f} |", flush=True)
print("ALL CHECKS", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
