"""Scratch: three calls of the current sparse MLA kernel (B 64, H 128) for ncu."""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, make_pool  # noqa: E402

from kernels.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402

fmt = sys.argv[1]
pool = make_pool(fmt)
q = torch.randn(64, 128, 576, device="cuda").bfloat16()
idx = torch.randint(0, POOL_ROWS, (64, 2048), device="cuda", dtype=torch.int32)
for _ in range(3):
    sparse_mla_decode_triton(q, pool, idx, SCALE)
torch.cuda.synchronize()
