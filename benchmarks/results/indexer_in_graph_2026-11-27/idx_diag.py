# ruff: noqa  -- kept as it ran on the device (2026-11-27, session 20), a one-off experiment
"""Issue 23 item 1, B 16 at 32K: diagnostic variants of the scores kernel (e4m3 q) against the default, same inputs and
timing as bench_indexer.py (events after an L2-flushing read; and in a replayed graph). Scores compared bit for bit."""
import argparse
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import bench_indexer as bi  # noqa: E402

from kernels import indexer_fast as F  # noqa: E402

sys.path.insert(0, "benchmarks/results/indexer_in_graph_2026-11-27")
from scores_diag import _scores_kernel_diag  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--shapes", default="16:32768,16:65536,64:32768")
args = parser.parse_args()
bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
bench.report.hbm_copy_gbps = bi.hbm_copy_gbps()
print(f"{torch.cuda.get_device_name()} copy {bench.report.hbm_copy_gbps:.0f} GB/s")


def launch(q8, w8, keys, scales, rows, req, lens, stages=5, warps=4, block_n=64, maxnreg=None, per_sm=None,
           diag=None):
    num_q, heads, _ = q8.shape
    max_len = rows.shape[1]
    padded = triton.cdiv(max_len, 64) * 64
    out = torch.empty((num_q, padded), dtype=torch.float32, device=q8.device)[:, :max_len]
    key = ("var", stages, warps, block_n, maxnreg, diag)
    resident = per_sm or F._RESIDENT.get(key, 4)
    per_prog = F.blocks_per_program(num_q, max_len, block_n, q8.device, resident)
    grid = (num_q, triton.cdiv(max_len, per_prog * block_n))
    extra = {"maxnreg": maxnreg} if maxnreg else {}
    kern = F._scores_kernel
    if diag is not None:
        kern, extra = _scores_kernel_diag, extra | {"NOREQ": "noreq" in diag, "NOSCALE": "noscale" in diag}
    kernel = kern[grid](
        q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, rows, req, lens, out,
        q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), rows.stride(0), rows.stride(1), out.stride(0),
        heads, max_len, per_prog, HEADS_P=64, BLOCK_N=block_n, PRECISION=2, Q_E4M3=True,
        num_warps=warps, num_stages=stages, **extra)
    if key not in F._RESIDENT:
        F._RESIDENT[key] = F._resident_programs(kernel, warps, 0)
        print(f"  variant {key}: {kernel.n_regs} regs, {kernel.metadata.shared} B smem, "
              f"{F._RESIDENT[key]} programs/SM, spill {getattr(kernel, 'n_spills', '?')}")
    return out


VARIANTS = [
    ("default (5 st)", {}),
    ("copy", {"diag": ""}),
    ("no req/len loads", {"diag": "noreq"}),
    ("no scale loads", {"diag": "noscale"}),
    ("neither", {"diag": "noreq noscale"}),
]
rows_out = []
for shape in args.shapes.split(","):
    batch, length = map(int, shape.split(":"))
    q, w, keys, scales, token_rows, req, lens = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = F.quantize_query(q, w)
    nbytes = batch * length * bi.BYTES_PER_POSITION
    ref = F.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, lens)
    for name, kw in VARIANTS:
        try:
            fn = lambda kw=kw: launch(q8, w8, keys, scales, token_rows, req, lens, **kw)  # noqa: E731
            same = bool(torch.equal(fn(), ref))
            ev, gr = bench.time(fn), bench.graph_us(fn)
            rows_out.append((shape, name, ev, bench.fraction(nbytes, ev), gr, bench.fraction(nbytes, gr), same))
            if name == "default (5 st)":  # q, w, req, lens in L2 as in the step (the keys and rows flushed)
                def warm(q8=q8, w8=w8, req=req, lens=lens):
                    bench.flush_read()
                    for t in (q8.view(torch.uint8), w8, req, lens):
                        t.sum()
                from _timing import time_gpu_us
                wu = time_gpu_us(fn, reset=warm)
                rows_out.append((shape, "default, small in L2", wu, bench.fraction(nbytes, wu), float("nan"),
                                 float("nan"), same))
        except Exception as exc:  # noqa: BLE001
            print(f"  {shape} {name} failed: {exc!r}"[:300])
    torch.cuda.empty_cache()
print("\nshape        variant              events us  frac |  graph us  frac | same bits")
for r in rows_out:
    print(f"{r[0]:12s} {r[1]:20s} {r[2]:8.1f} {r[3]:6.1%} | {r[4]:8.1f} {r[5]:6.1%} | {r[6]}")
