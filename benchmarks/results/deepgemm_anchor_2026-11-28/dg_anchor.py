# ruff: noqa  -- kept as it ran (from bench_tmp/), issue 23 item 1 anchor, 2026-11-28
"""Issue 23 item 1's anchor: DeepGEMM's paged FP8 MQA-logits kernel (SM90) against our scores kernel on the same
keys (the engine's paged layout: random pages of 64 rows), the same e4m3 queries and weights, timed the same way
(bench_indexer.Bench: in a replayed graph of 16 (L2 flush, call) pairs against 16 flushes; and by events)."""
import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, str(Path.cwd()))
import deep_gemm  # noqa: E402
from bench_indexer import BYTES_PER_POSITION, HEADS, PAGE, Bench, hbm_copy_gbps  # noqa: E402

from kernels.indexer_fast import FastScoresConfig, indexer_scores_fast, quantize_query  # noqa: E402

logging.basicConfig(level=logging.WARNING, format="%(message)s")
bench = Bench(argparse.Namespace(layout="paged", flush="read", json=None))
copy = bench.report.hbm_copy_gbps = hbm_copy_gbps()
num_sms = deep_gemm.get_num_sms()
print(f"{torch.cuda.get_device_name()}  copy {copy:.0f} GB/s  deep_gemm {deep_gemm.__version__}  SMs {num_sms}",
      flush=True)
keys, scales = bench.keys, bench.scales
pages = keys.shape[0] // PAGE
kv = torch.empty(pages, PAGE * 132, dtype=torch.uint8, device="cuda")  # DeepGEMM's block: 64 keys, then 64 scales
kv[:, : PAGE * 128] = keys.view(torch.uint8).view(pages, PAGE * 128)
kv[:, PAGE * 128 :] = scales.view(torch.uint8).view(pages, PAGE * 4)
kv = kv.view(pages, PAGE, 1, 132)
cfg = FastScoresConfig(precision="fp8")
table = []
shapes = [(1, 32768), (16, 8192), (16, 32768), (16, 65536), (16, 131072), (64, 32768), (64, 65536), (64, 131072)]
for batch, length in shapes:
    q, w, _, _, token_rows, req, seq = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = quantize_query(q, w)
    write = bench.key_write((q, w, keys, scales, token_rows, req, seq), batch)

    def ours(q8=q8, w8=w8, token_rows=token_rows, req=req, seq=seq):
        return indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, cfg)

    def ours_early(q8=q8, w8=w8, token_rows=token_rows, req=req, seq=seq):
        return indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq, cfg, tables_ready=True)

    block_table = (token_rows[:, ::PAGE] // PAGE).to(torch.int32).contiguous()
    ctx = seq.to(torch.int32).view(batch, 1).contiguous()
    meta = deep_gemm.get_paged_mqa_logits_metadata(ctx, PAGE, num_sms)
    qd = q8.view(batch, 1, HEADS, 128)
    wd = w8.float().contiguous()

    def dg(qd=qd, wd=wd, ctx=ctx, block_table=block_table, meta=meta, length=length):
        return deep_gemm.fp8_paged_mqa_logits(qd, kv, wd, ctx, block_table, meta, length, False)

    a, b = ours(), dg()
    torch.cuda.synchronize()
    err = float((a - b[:, :length]).abs().max() / a.abs().max())
    nbytes = batch * length * BYTES_PER_POSITION
    read_ev, read_graph = bench.read_us(nbytes)
    row = {"B": batch, "L": length, "err": err, "read": read_graph,
           "ours": bench.graph_us(ours), "ours_early": bench.graph_us(ours_early, before=write),
           "dg": bench.graph_us(dg), "dg_after_write": bench.graph_us(dg, before=write),
           "ours_ev": bench.time(ours), "dg_ev": bench.time(dg),
           "meta_us": bench.time(lambda ctx=ctx: deep_gemm.get_paged_mqa_logits_metadata(ctx, PAGE, num_sms))}
    if hasattr(deep_gemm, "set_pdl"):
        deep_gemm.set_pdl(True)
        dg()
        row["dg_pdl_after_write"] = bench.graph_us(dg, before=write)
        deep_gemm.set_pdl(False)
    table.append(row)
    print(row, flush=True)


def pct(r, key):
    us = r.get(key, float("nan"))
    return f"{us:6.1f} {bench.fraction(r['B'] * r['L'] * BYTES_PER_POSITION, us):6.1%}"


print(f"\nus in a replayed graph and fraction of the copy's rate ({copy:.0f} GB/s), bytes B*L*140 for every column")
print("   B       L | read floor     | ours plain     | ours after write (early) | DeepGEMM plain | DeepGEMM after "
      "write | DeepGEMM PDL after write | events ours / DG | meta | err")
for r in table:
    print(f"{r['B']:4d} {r['L']:7d} | {pct(r, 'read')} | {pct(r, 'ours')} | {pct(r, 'ours_early'):>24} | "
          f"{pct(r, 'dg')} | {pct(r, 'dg_after_write'):>20} | {pct(r, 'dg_pdl_after_write'):>24} | "
          f"{r['ours_ev']:6.1f} / {r['dg_ev']:6.1f} | {r['meta_us']:4.1f} | {r['err']:.1e}")
