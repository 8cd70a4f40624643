# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1 (2026-11-28): per-program timelines of the scores kernel at B 16 / 32K and a work-queue variant.
Same inputs and timing as bench_indexer.py (events after an L2-flushing read; a replayed graph)."""
import argparse
import statistics
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/results/indexer_tail_2026-11-28")
import bench_indexer as bi
from scores_tail import _scores_queue, _scores_timed

from kernels import indexer_fast as F

bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
bench.report.hbm_copy_gbps = bi.hbm_copy_gbps()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
print(f"{torch.cuda.get_device_name()} copy {bench.report.hbm_copy_gbps:.0f} GB/s, {SMS} SMs", flush=True)


def out_like(q8, rows):
    padded = triton.cdiv(rows.shape[1], 64) * 64
    return torch.empty((q8.shape[0], padded), dtype=torch.float32, device=q8.device)[:, :rows.shape[1]]


def timed(q8, w8, keys, scales, rows, req, lens, first, ts=None):
    num_q, heads, _ = q8.shape
    max_len = rows.shape[1]
    resident = F._RESIDENT.get((F.DEFAULT_CONFIG, 64, True, 0), 5)
    per_prog = F.blocks_per_program(num_q, max_len, 64, q8.device, resident)
    grid = (num_q, triton.cdiv(max_len, per_prog * 64))
    out = out_like(q8, rows)
    if ts is None:
        ts = torch.zeros(grid[0] * grid[1], 4, dtype=torch.int64, device=q8.device)
    _scores_timed[grid](q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, rows, req, lens, out, ts,
                        q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), rows.stride(0), rows.stride(1), out.stride(0),
                        heads, max_len, per_prog, HEADS_P=64, BLOCK_N=64, FIRST=first, num_warps=4, num_stages=5)
    return out, ts


QUEUE_RESIDENT = {}


def queue(q8, w8, keys, scales, rows, req, lens, chunk, counter, per_sm=None):
    num_q, heads, _ = q8.shape
    max_len = rows.shape[1]
    spans = triton.cdiv(max_len, chunk * 64)
    resident = per_sm or QUEUE_RESIDENT.get(chunk, 4)
    programs = min(resident * SMS, num_q * spans)
    out = out_like(q8, rows)
    k = _scores_queue[(programs,)](q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, rows, req, lens, out, counter,
                                   q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), rows.stride(0), rows.stride(1), out.stride(0),
                                   heads, max_len, num_q, spans, programs, HEADS_P=64, BLOCK_N=64, CHUNK=chunk,
                                   num_warps=4, num_stages=5)
    if chunk not in QUEUE_RESIDENT:
        QUEUE_RESIDENT[chunk] = F._resident_programs(k, 4, 0)
        print(f"  queue chunk {chunk}: {k.n_regs} regs, {QUEUE_RESIDENT[chunk]} programs/SM", flush=True)
    return out


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * (len(xs) - 1) + 0.5))]


def timeline(q8, w8, keys, scales, rows, req, lens, first, nbytes):
    """One call after the L2 flush; entry / first block / exit per program relative to the earliest entry (µs)."""
    runs = []
    for _ in range(5):
        bench.flush_read()
        torch.cuda._sleep(2_000_000)
        _, ts = timed(q8, w8, keys, scales, rows, req, lens, first)
        torch.cuda.synchronize()
        runs.append(ts.cpu())
    ts = runs[2]
    t0 = int(ts[:, 0].min())
    entry = [(int(x) - t0) / 1e3 for x in ts[:, 0]]
    exit_ = [(int(x) - t0) / 1e3 for x in ts[:, 2]]
    dur = [b - a for a, b in zip(entry, exit_)]
    line = (f"    entry p0/50/100 {pct(entry,0):.2f}/{pct(entry,.5):.2f}/{pct(entry,1):.2f}  "
            f"exit p0/10/50/90/100 {pct(exit_,0):.2f}/{pct(exit_,.1):.2f}/{pct(exit_,.5):.2f}/{pct(exit_,.9):.2f}/{pct(exit_,1):.2f}  "
            f"program time p50 {pct(dur,.5):.2f}")
    if first:
        fb = [(int(x) - t0) / 1e3 for x in ts[:, 1]]
        line += f"  first block done p0/50/90/100 {pct(fb,0):.2f}/{pct(fb,.5):.2f}/{pct(fb,.9):.2f}/{pct(fb,1):.2f}"
    sm_last = {}
    for s, e in zip(ts[:, 3].tolist(), exit_):
        sm_last[s] = max(sm_last.get(s, 0.0), e)
    lasts = sorted(sm_last.values())
    line += f"\n    per-SM last exit p0/50/100 {lasts[0]:.2f}/{pct(lasts,.5):.2f}/{lasts[-1]:.2f} over {len(lasts)} SMs"
    span = max(exit_)
    line += f"; bytes / (last exit - first entry) = {nbytes / (span * 1e-6) / 1e9 / bench.report.hbm_copy_gbps:.1%} of the copy"
    # the bytes a program covers are equal; rate while all programs run vs the whole
    line += f"; {sum(e <= pct(exit_, 1) - 2.0 for e in exit_)}/{len(exit_)} programs done 2 µs before the last"
    print(line, flush=True)


rows_out = []
for shape in ("16:32768", "16:65536", "64:32768"):
    batch, length = map(int, shape.split(":"))
    q, w, keys, scales, token_rows, req, lens = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = F.quantize_query(q, w)
    nbytes = batch * length * bi.BYTES_PER_POSITION
    args = (q8, w8, keys, scales, token_rows, req, lens)
    ref = F.indexer_scores_fast(*args)
    read_ev, read_gr = bench.read_us(nbytes)
    rows_out.append((shape, "streaming read", read_ev, bench.fraction(nbytes, read_ev), read_gr, bench.fraction(nbytes, read_gr), True))
    cases = [("product", lambda: F.indexer_scores_fast(*args))]
    cases += [("timed", lambda: timed(*args, False)[0]), ("timed+first", lambda: timed(*args, True)[0])]
    counter = torch.zeros(2, dtype=torch.int32, device="cuda")
    for chunk in (2, 4, 8):
        cases.append((f"queue chunk {chunk}", lambda chunk=chunk: queue(*args, chunk, counter)))
        cases.append((f"queue chunk {chunk}, 5/SM", lambda chunk=chunk: queue(*args, chunk, counter, per_sm=5)))
    for name, fn in cases:
        try:
            out = fn()
            out = fn()
            torch.cuda.synchronize()
            same = bool(torch.equal(out, ref)) and int(counter.abs().sum()) == 0
            ev, gr = bench.time(fn), bench.graph_us(fn)
            same = same and bool(torch.equal(fn(), ref))
            rows_out.append((shape, name, ev, bench.fraction(nbytes, ev), gr, bench.fraction(nbytes, gr), same))
        except Exception as exc:  # noqa: BLE001
            print(f"  {shape} {name} failed: {exc!r}"[:400], flush=True)
    print(f"{shape}: timelines (one call after the flush; µs from the first program's entry)", flush=True)
    for first in (False, True):
        try:
            print(f"  FIRST={first}", flush=True)
            timeline(*args, first, nbytes)
        except Exception as exc:  # noqa: BLE001
            print(f"  timeline failed: {exc!r}"[:400], flush=True)
    torch.cuda.empty_cache()
print("\nshape        variant                  events us  frac |  graph us  frac | same bits")
for r in rows_out:
    print(f"{r[0]:12s} {r[1]:24s} {r[2]:8.1f} {r[3]:6.1%} | {r[4]:8.1f} {r[5]:6.1%} | {r[6]}")
