# ruff: noqa  -- experiment script
"""The balanced scores kernel as integrated (kernels/indexer_fast.py), timed like bench_indexer after the key
write: product (per-query) early vs balanced early (default registers, maxnreg 128 and 96) vs balanced plain (prepared 2026-11-28, not yet run)."""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, str(Path.cwd()))
import torch
from bench_indexer import BYTES_PER_POSITION, Bench, hbm_copy_gbps

from kernels import indexer_fast as f

bench = Bench(argparse.Namespace(layout="paged", flush="read", json=None))
copy = bench.report.hbm_copy_gbps = hbm_copy_gbps()
print(torch.cuda.get_device_name(), f"copy {copy:.0f}", flush=True)
keys, scales = bench.keys, bench.scales
variants = {"product": f.FastScoresConfig(balanced=False), "balanced": f.FastScoresConfig(balanced=True),
            "bal_r128": f.FastScoresConfig(balanced=True, max_registers=128),
            "bal_r96": f.FastScoresConfig(balanced=True, max_registers=96)}
rows = []
for batch, length, kind in [(16, 32768, "equal"), (64, 32768, "equal"), (64, 131072, "equal"), (16, 32768, "mixed"),
                            (64, 32768, "mixed"), (64, 131072, "mixed"), (128, 65536, "mixed")]:
    q, w, _, _, token_rows, req, seq = bench.inputs(batch, length, batch * 7 + length)
    if kind == "mixed":
        gen = torch.Generator(device="cuda").manual_seed(batch + length)
        seq = torch.randint(length // 8, length + 1, (batch,), device="cuda", generator=gen)
    write = bench.key_write((q, w, keys, scales, token_rows, req, seq), batch)
    q8, w8 = f.quantize_query(q, w)
    nbytes = int(seq.sum()) * BYTES_PER_POSITION
    ref = f.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, variants["product"])
    row = {"B": batch, "L": length, "kind": kind}
    for name, cfg in variants.items():
        for early in (True, False):
            got = f.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, cfg, tables_ready=early)
            torch.cuda.synchronize()
            same = all(torch.equal(got[t, :n], ref[t, :n]) for t, n in enumerate(seq.tolist()))
            us = bench.graph_us(lambda cfg=cfg, early=early: f.indexer_scores_fast(
                q8, w8, keys, scales, token_rows, req, seq, cfg, tables_ready=early), before=write if early else None)
            row[f"{name}{'_early' if early else ''}"] = (us, bench.fraction(nbytes, us), same)
    rows.append(row)
    print(row, flush=True)
print("resident", {k[0] if isinstance(k[0], str) else "product": v for k, v in f._RESIDENT.items()})
print("\nus in a graph (after the key write for _early; after a flush otherwise), fraction of the copy, same bits")
for r in rows:
    cells = "  ".join(f"{k} {v[0]:6.1f} {v[1]:5.1%}{'' if v[2] else ' DIFF'}" for k, v in r.items() if isinstance(v, tuple))
    print(f"{r['B']:3d} {r['L']:7d} {r['kind']:5s} | {cells}")
