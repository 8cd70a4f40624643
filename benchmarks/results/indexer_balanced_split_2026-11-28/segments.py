# ruff: noqa  -- kept as it ran on the device, 2026-11-28 (ad9c303 + the tried kernel change, reverted)
"""The balanced kernel with each segment's request / length / row ids loaded once (handed from the previous
segment or from before the wait) against the kernel before (bench_tmp/indexer_fast_old.py = HEAD's) and the
per-query kernel, early after the key write, in a graph; two passes."""
import argparse
import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, str(Path.cwd()))
import torch
from bench_indexer import BYTES_PER_POSITION, Bench, hbm_copy_gbps

from kernels import indexer_fast as new

spec = importlib.util.spec_from_file_location("indexer_fast_old", "bench_tmp/indexer_fast_old.py")
old = importlib.util.module_from_spec(spec)
sys.modules["indexer_fast_old"] = old
spec.loader.exec_module(old)
bench = Bench(argparse.Namespace(layout="paged", flush="read", json=None))
copy = bench.report.hbm_copy_gbps = hbm_copy_gbps()
print(torch.cuda.get_device_name(), f"copy {copy:.0f}", flush=True)
keys, scales = bench.keys, bench.scales
rows = []
for batch, length, kind in [(16, 32768, "equal"), (64, 32768, "equal"), (64, 131072, "equal"), (16, 65536, "equal"),
                            (16, 32768, "mixed"), (64, 32768, "mixed"), (64, 131072, "mixed"), (128, 65536, "mixed")]:
    q, w, _, _, token_rows, req, seq = bench.inputs(batch, length, batch * 7 + length)
    if kind == "mixed":
        gen = torch.Generator(device="cuda").manual_seed(batch + length)
        seq = torch.randint(length // 8, length + 1, (batch,), device="cuda", generator=gen)
    write = bench.key_write((q, w, keys, scales, token_rows, req, seq), batch)
    q8, w8 = new.quantize_query(q, w)
    nbytes = int(seq.sum()) * BYTES_PER_POSITION
    variants = {
        "per_query": lambda: new.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq,
                                                     new.FastScoresConfig(balanced=False), tables_ready=True),
        "bal_old": lambda: old.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, tables_ready=True),
        "bal_new": lambda: new.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, tables_ready=True),
    }
    ref = variants["per_query"]()
    row = {"B": batch, "L": length, "kind": kind}
    for name, fn in variants.items():
        got = fn()
        torch.cuda.synchronize()
        row[name + "_same"] = all(torch.equal(got[t, :n], ref[t, :n]) for t, n in enumerate(seq.tolist()))
    for rep in (1, 2):
        for name, fn in variants.items():
            us = bench.graph_us(fn, before=write)
            row[f"{name}{rep}"] = (us, bench.fraction(nbytes, us))
    rows.append(row)
    print(row, flush=True)
print("resident", {k[0] if isinstance(k[0], str) else "product": v for k, v in new._RESIDENT.items()})
print("\nus in a graph after the key write (early start), fraction of the copy; two passes; same bits as per-query")
for r in rows:
    cells = "  ".join(f"{k} {v[0]:6.1f} {v[1]:5.1%}" for k, v in r.items() if isinstance(v, tuple))
    same = all(v for k, v in r.items() if k.endswith("_same"))
    print(f"{r['B']:3d} {r['L']:7d} {r['kind']:5s} | {cells} | same {same}")
