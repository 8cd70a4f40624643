"""Prepared (not yet run): the Triton sparse MLA kernel's FP8 path with the RoPE part's offsets declared 16-byte
aligned (`triton_rope.py`, ROPE_ALIGNED). Compiled for sm_90 without it, the loop loads that tile's index entries
and then the RoPE part synchronously every iteration (a dependent global-load chain: the stall the Gluon kernel
lost 6-10 % to); with it both become pipelined cp.async (TTGIR: 10 async copies, 2 masked next-iteration loads).
Checks the same bits as the product kernel (FP8 rows: 128, 64 and 16 heads, splits, skipped entries), then times
product / variant / FlashMLA (L2 flushed) at the shapes the Triton kernel serves: other GPUs' 64 / 128 heads and
TP ranks' 16 heads."""
# ruff: noqa: B023, E402, I001, E702
import sys

import torch

sys.path.insert(0, "benchmarks"); sys.path.insert(0, "benchmarks/results/sparse_mla_triton_rope_prep_2026-11-28")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool
from kernels.fp8_rows import pack_fp8_rows
from kernels.sparse_mla_triton import default_config, sparse_mla_decode_triton as now
from triton_rope import sparse_mla_decode_triton as rope

try:
    from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla
except ImportError:
    sparse_mla_decode_flashmla = None

torch.manual_seed(1)
ok = True
rows = torch.randn(5000, 576, device="cuda")
pool = pack_fp8_rows(rows)
for batch, heads, top_k, splits in ((3, 128, 2048, 1), (3, 64, 2048, 4), (5, 16, 2048, 2), (4, 16, 128, 1),
                                    (2, 64, 64, 1)):
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    idx = torch.randint(0, 5000, (batch, top_k), device="cuda", dtype=torch.int32)
    idx[0, ::7] = -1
    idx[-1, : top_k // 2] = -1
    cfg = {**default_config(heads, True), "SPLITS": splits}
    base = now(q, pool, idx, SCALE, config=cfg)
    got = rope(q, pool, idx, SCALE, config=cfg)
    same = torch.equal(got[0], base[0]) and torch.equal(got[1], base[1])
    ok &= same
    print(f"fp8 B {batch} H {heads} K {top_k} s {splits}: same bits {same}")
del pool, rows
flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
pool = make_pool("fp8")
print("| H | B | FlashMLA | Triton now | Triton RoPE aligned | now/aligned | FM/now | FM/aligned |")
for heads, batch in ((128, 64), (128, 128), (64, 64), (16, 64), (16, 256)):
    qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
    idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
    fm = (bench(lambda i: sparse_mla_decode_flashmla(qs[i], pool, idx[i], SCALE), 2, flush)
          if sparse_mla_decode_flashmla is not None and heads in (64, 128) else float("nan"))
    t0 = bench(lambda i: now(qs[i], pool, idx[i], SCALE), 2, flush)
    t1 = bench(lambda i: rope(qs[i], pool, idx[i], SCALE), 2, flush)
    t0b = bench(lambda i: now(qs[i], pool, idx[i], SCALE), 2, flush)
    print(f"| {heads} | {batch} | {fm:.1f} | {t0:.1f} ({t0b:.1f}) | {t1:.1f} | {t0 / t1:.3f} | {fm / t0:.3f} | "
          f"{fm / t1:.3f} |", flush=True)
print("ALL CHECKS", "PASS" if ok else "FAIL")
sys.exit(0 if ok else 1)
