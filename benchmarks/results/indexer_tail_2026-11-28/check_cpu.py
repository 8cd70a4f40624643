# ruff: noqa  -- kept as it ran (CPU, 2026-11-28), a one-off check
import sys
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/results/indexer_tail_2026-11-28")
from kernels import triton_interpret
triton_interpret.enable()
import torch
from scores_tail import _scores_queue
from kernels import indexer_fast as F
g = torch.Generator().manual_seed(0)
T, H, L, N = 3, 64, 700, 4000
q = torch.randn(T, H, 128, generator=g)
w = torch.randn(T, H, generator=g)
q8, w8 = F.quantize_query(q, w)
from kernels.indexer_ref import quantize_index_keys
keys, scales = quantize_index_keys(torch.randn(N, 128, generator=g))
rows = torch.randint(0, N, (2, L), generator=g, dtype=torch.int32)
rows[1, 100:164] = -1
req = torch.tensor([0, 1, 0])
lens = torch.tensor([700, 650, 5])
ref = F.indexer_scores_fast(q8, w8, keys, scales, rows, req, lens)
counter = torch.zeros(2, dtype=torch.int32)
for chunk in (2, 4):
    out = torch.full_like(ref, float("nan"))
    spans = -(-L // (chunk * 64))
    programs = 5
    _scores_queue[(programs,)](q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, rows, req, lens, out, counter,
                              q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), rows.stride(0), rows.stride(1), out.stride(0),
                              H, L, T, spans, programs, HEADS_P=64, BLOCK_N=64, CHUNK=chunk)
    m = torch.arange(L)[None, :] < lens[:, None]
    print(chunk, torch.equal(out[m], ref[m]), counter.tolist())
