"""For the next GPU session (issue 23 item 1): the paged TMA scores kernel (`scores_paged.py`) against the gather
kernel the engine runs (kernels/indexer_fast.py, e4m3 q) and a streaming read of the same bytes, with
bench_indexer.py's inputs (paged keys) and timing (events after an L2-evicting read; in a replayed graph); the
scores compared bit for bit. Prints one table (fraction of the copy's rate).

    PYTHONPATH=$PWD python3 benchmarks/results/indexer_paged_tma_2026-11-27/time_gpu.py
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "benchmarks")
import bench_indexer as bi  # noqa: E402
from scores_paged import paged_scores  # noqa: E402

from kernels.indexer_fast import indexer_scores_fast, quantize_query  # noqa: E402

SHAPES = ((16, 32768), (16, 65536), (16, 131072), (64, 32768), (64, 131072))
VARIANTS = {"paged (5 stages)": {}, "paged 4 stages": {"num_stages": 4}, "paged 6 stages": {"num_stages": 6},
            "paged 8 warps": {"num_warps": 8}, "paged + PDL": {"pdl": True}}


def case(bench: bi.Bench, batch: int, length: int) -> list[tuple]:
    """(B, L, kernel, events µs, graph µs, same bits as the engine's kernel) at one shape, the read first."""
    args = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = quantize_query(args[0], args[1])
    rest = args[2:]
    want = indexer_scores_fast(q8, w8, *rest)
    rows = [(batch, length, bi.READ_FLOOR, *bench.read_us(batch * length * bi.BYTES_PER_POSITION), True)]
    kernels = {"gather (engine)": lambda: indexer_scores_fast(q8, w8, *rest)}
    for name, kw in VARIANTS.items():
        kernels[name] = lambda kw=kw: paged_scores(q8, w8, *rest, **kw)
    for name, fn in kernels.items():
        same = bool(torch.equal(fn(), want))
        rows.append((batch, length, name, bench.time(fn), bench.graph_us(fn), same))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
    bench.report.hbm_copy_gbps = bi.hbm_copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {bench.report.hbm_copy_gbps:.0f} GB/s")
    rows = []
    for batch, length in SHAPES:
        rows += case(bench, batch, length)
        torch.cuda.empty_cache()
    print("\n| B | L | kernel | events µs | of the copy | graph µs | of the copy | same bits |")
    for batch, length, name, ev, graph, same in rows:
        nbytes = batch * length * bi.BYTES_PER_POSITION
        print(f"| {batch} | {length} | {name} | {ev:.1f} | {bench.fraction(nbytes, ev):.1%} | {graph:.1f} | "
              f"{bench.fraction(nbytes, graph):.1%} | {same} |")


if __name__ == "__main__":
    main()
