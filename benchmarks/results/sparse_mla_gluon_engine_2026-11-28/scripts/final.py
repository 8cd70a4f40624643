"""Final code: FlashMLA / Triton / Gluon at batch 64 and 128, 128 heads, K 2048, both row formats."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool  # noqa: E402

from kernels.sparse_mla_flashmla import sparse_mla_decode_flashmla  # noqa: E402
from kernels.sparse_mla_gluon import sparse_mla_decode_gluon  # noqa: E402
from kernels.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402

flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("| rows | B | FlashMLA µs | Triton µs | Gluon µs | FlashMLA/Triton | FlashMLA/Gluon |")
for fmt in ("bf16", "fp8"):
    pool = make_pool(fmt)
    for batch in (64, 128):
        qs = [torch.randn(batch, 128, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, 2048), device="cuda", dtype=torch.int32) for _ in range(2)]
        t = {name: bench(lambda i, f=f, q=qs, ix=idx, p=pool: f(q[i], p, ix[i], SCALE), 2, flush) for name, f in
             (("flashmla", sparse_mla_decode_flashmla), ("triton", sparse_mla_decode_triton),
              ("gluon", sparse_mla_decode_gluon))}
        print(f"| {fmt} | {batch} | {t['flashmla']:.1f} | {t['triton']:.1f} | {t['gluon']:.1f} | "
              f"{t['flashmla'] / t['triton']:.2f} | {t['flashmla'] / t['gluon']:.3f} |", flush=True)
    del pool
    torch.cuda.empty_cache()
