# ruff: noqa  -- kept as it ran (from bench_tmp/), issue 23 item 2 anchor, 2026-11-28
"""Issue 23 item 2's anchor: SGLang's fast top-k for DSA (sgl-kernel `fast_topk`, 2048 of each row) against the
engine's CUDA top-k (kernels/topk_cuda.py) and torch.topk, same fp32 rows, timed like bench_indexer (L2 flushed
before each call; events, and what a call adds to a replayed graph of flushes)."""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, str(Path.cwd()))
from bench_indexer import Bench  # noqa: E402
from torch.utils.cpp_extension import load  # noqa: E402

from kernels.indexer_fast import indexer_scores_fast  # noqa: E402
from kernels.topk_cuda import topk_positions_cuda  # noqa: E402

TOP_K = 2048
bench = Bench(argparse.Namespace(layout="paged", flush="read", json=None))
topk_positions_cuda(torch.randn(2, 8192, device="cuda"), torch.full((2,), 8192, device="cuda"), TOP_K)  # build ours
sgl = load(name="sgl_topk", sources=["bench_tmp/sgl/topk.cu", "bench_tmp/sgl/binding.cpp"],
           build_directory="/tmp/sgl_build", extra_cflags=["-O3", "-std=c++17"],
           extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"])
print(torch.cuda.get_device_name(), flush=True)
table = []
cases = [(b, n, "randn") for b in (1, 16, 64, 128) for n in (32768, 65536, 131072)]
cases += [(16, 32768, "indexer"), (64, 32768, "indexer"), (64, 131072, "indexer")]
for batch, length, source in cases:
    if source == "randn":
        gen = torch.Generator(device="cuda").manual_seed(batch + length)
        scores = torch.randn(batch, length, device="cuda", generator=gen)
    else:
        scores = indexer_scores_fast(*bench.inputs(batch, length, batch * 7 + length))
    seq = torch.full((batch,), length, device="cuda", dtype=torch.int64)
    lens32 = seq.to(torch.int32)
    out = torch.empty(batch, TOP_K, dtype=torch.int32, device="cuda")

    def ours(scores=scores, seq=seq):
        return topk_positions_cuda(scores, seq, TOP_K)

    def theirs(scores=scores, out=out, lens32=lens32):
        sgl.fast_topk(scores, out, lens32)
        return out

    def torch_topk(scores=scores):
        return torch.topk(scores, TOP_K, dim=1, sorted=False)

    mine, other = ours(), theirs().clone()
    torch.cuda.synchronize()
    same_rows = int((torch.sort(other, dim=1).values == mine).all(dim=1).sum())
    ref = torch.sort(torch.topk(scores, TOP_K, dim=1).indices.to(torch.int32), dim=1).values
    ours_ref = int((ref == mine).all(dim=1).sum())
    row = {"B": batch, "L": length, "src": source, "same_rows": same_rows, "ours_eq_torch_rows": ours_ref,
           "ours_g": bench.graph_us(ours), "sgl_g": bench.graph_us(theirs), "torch_g": bench.graph_us(torch_topk),
           "ours_ev": bench.time(ours), "sgl_ev": bench.time(theirs), "torch_ev": bench.time(torch_topk)}
    table.append(row)
    print(row, flush=True)

print("\nus (graph: what a call adds to a replayed graph of L2 flushes; ev: events), rows where SGLang's set == ours")
print("   B       L src     | ours graph / ev | SGLang graph / ev | torch unsorted graph / ev | SGLang/ours (graph) | same")
for r in table:
    print(f"{r['B']:4d} {r['L']:7d} {r['src']:7s} | {r['ours_g']:6.1f} / {r['ours_ev']:6.1f} | "
          f"{r['sgl_g']:6.1f} / {r['sgl_ev']:6.1f} | {r['torch_g']:7.1f} / {r['torch_ev']:7.1f} | "
          f"{r['sgl_g'] / r['ours_g']:5.2f} | {r['same_rows']}/{r['B']} (ours == torch {r['ours_eq_torch_rows']})")
