# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1 (2026-11-28): the scores kernel with L2 key prefetches ahead of its pipeline, against the
product kernel and the streaming read of the same bytes; bench_indexer.py's inputs and timing (events after an
L2-flushing read; a replayed graph); scores compared bit for bit."""
import argparse
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/results/indexer_tail_2026-11-28")
import bench_indexer as bi
from scores_pf import _scores_pf

from kernels import indexer_fast as F

bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
bench.report.hbm_copy_gbps = bi.hbm_copy_gbps()
print(f"{torch.cuda.get_device_name()} copy {bench.report.hbm_copy_gbps:.0f} GB/s", flush=True)


def pf(q8, w8, keys, scales, rows, req, lens, dist, start_pf, bulk, stages=5):
    num_q, heads, _ = q8.shape
    max_len = rows.shape[1]
    resident = F._RESIDENT.get((F.DEFAULT_CONFIG, 64, True, 0), 5)
    per_prog = F.blocks_per_program(num_q, max_len, 64, q8.device, resident)
    grid = (num_q, triton.cdiv(max_len, per_prog * 64))
    padded = triton.cdiv(max_len, 64) * 64
    out = torch.empty((num_q, padded), dtype=torch.float32, device=q8.device)[:, :max_len]
    k = _scores_pf[grid](q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, rows, req, lens, out,
                         q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), rows.stride(0), rows.stride(1), out.stride(0),
                         heads, max_len, per_prog, HEADS_P=64, BLOCK_N=64, PF=dist, START_PF=start_pf, BULK=bulk,
                         num_warps=4, num_stages=stages)
    key = (dist, start_pf, bulk, stages)
    if key not in SEEN:
        SEEN.add(key)
        print(f"  variant {key}: {k.n_regs} regs, {F._resident_programs(k, 4, 0)} programs/SM", flush=True)
    return out


SEEN = set()
VARIANTS = [("pf 0 (copy)", (0, 0, 0)), ("pf 2", (2, 0, 0)), ("pf 4", (4, 0, 0)), ("pf 8", (8, 0, 0)),
            ("pf 4 bulk", (4, 0, 1)), ("pf 8 bulk", (8, 0, 1)), ("start 4 bulk", (0, 4, 1)),
            ("start 4 + pf 4 bulk", (4, 4, 1)), ("pf 4, 4 stages", (4, 0, 0, 4))]
rows_out = []
for shape in ("16:32768", "16:65536", "64:32768", "16:131072"):
    batch, length = map(int, shape.split(":"))
    q, w, keys, scales, token_rows, req, lens = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = F.quantize_query(q, w)
    nbytes = batch * length * bi.BYTES_PER_POSITION
    args = (q8, w8, keys, scales, token_rows, req, lens)
    ref = F.indexer_scores_fast(*args)
    read_ev, read_gr = bench.read_us(nbytes)
    rows_out.append((shape, "streaming read", read_ev, bench.fraction(nbytes, read_ev), read_gr, bench.fraction(nbytes, read_gr), True))
    cases = [("product", lambda: F.indexer_scores_fast(*args))]
    cases += [(name, lambda v=v: pf(*args, *v)) for name, v in VARIANTS]
    for name, fn in cases:
        try:
            same = bool(torch.equal(fn(), ref))
            ev, gr = bench.time(fn), bench.graph_us(fn)
            rows_out.append((shape, name, ev, bench.fraction(nbytes, ev), gr, bench.fraction(nbytes, gr), same))
        except Exception as exc:  # noqa: BLE001
            print(f"  {shape} {name} failed: {exc!r}"[:400], flush=True)
    print(f"{shape} done", flush=True)
    torch.cuda.empty_cache()
print("\nshape        variant                  events us  frac |  graph us  frac | same bits")
for r in rows_out:
    print(f"{r[0]:12s} {r[1]:24s} {r[2]:8.1f} {r[3]:6.1%} | {r[4]:8.1f} {r[5]:6.1%} | {r[6]}")
