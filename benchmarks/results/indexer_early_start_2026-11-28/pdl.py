# ruff: noqa  -- kept as it ran on the device (2026-11-28), a one-off experiment
"""Issue 23 item 1 (2026-11-28): the scores kernel behind programmatic dependent launch, after the index-key
write (its real predecessor in the engine: attention.py write_index_keys → index_topk). Same inputs, flush and
copy rate as bench_indexer.py. Timed in replayed graphs: GRAPH_PAIRS × (flush, write, scores) against
GRAPH_PAIRS × (flush, write) — what the scores add where the engine runs them — and the write's own cost."""
import argparse
import statistics
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks/results/indexer_early_start_2026-11-28")
import bench_indexer as bi
from scores_pdl import _scores_pdl, _write_rows_kernel

from kernels import indexer_fast as F

bench = bi.Bench(argparse.Namespace(layout="paged", flush="read", json=None))
bench.report.hbm_copy_gbps = bi.hbm_copy_gbps()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
print(f"{torch.cuda.get_device_name()} copy {bench.report.hbm_copy_gbps:.0f} GB/s, {SMS} SMs", flush=True)
PAIRS, REPLAYS = 16, 15
SHAPES = [(16, 32768), (16, 65536), (64, 32768), (16, 131072), (64, 131072)]


def graph_time(fns):
    """Median replay time (µs) of one graph of PAIRS × (flush, *fns)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(PAIRS):
            bench.evict_l2()
            for f in fns:
                f()
    g.replay()
    torch.cuda.synchronize()
    return g


def replay_all(graphs):
    times = {k: [] for k in graphs}
    for _ in range(REPLAYS):
        for k, g in graphs.items():
            torch.cuda._sleep(1_000_000)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times[k].append(s.elapsed_time(e) * 1000.0)
    return {k: statistics.median(v) for k, v in times.items()}


rows_out = []
for batch, length in SHAPES:
    q, w, keys, scales, token_rows, req, seq = bench.inputs(batch, length, batch * 7 + length)
    q8, w8 = F.quantize_query(q, w)
    req = req.to(torch.int64)
    new_rows = token_rows[torch.arange(batch, device="cuda"), seq - 1].to(torch.int64)
    new_keys = keys[new_rows].clone()
    new_scales = scales[new_rows].clone()
    keys_u8 = keys.view(torch.uint8)
    product = F.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq)
    torch.cuda.synchronize()
    resident = F._RESIDENT.get((F.DEFAULT_CONFIG, 64, True, 0), 4)
    per_prog = F.blocks_per_program(batch, length, 64, q8.device, resident)
    grid = (batch, triton.cdiv(length, per_prog * 64))
    outs = {}

    def write_torch():
        keys[new_rows] = new_keys
        scales[new_rows] = new_scales

    def write_triton(trigger):
        _write_rows_kernel[(triton.cdiv(batch, 16),)](new_keys.view(torch.uint8), new_scales, new_rows, keys_u8, scales,
                                                      128, keys.stride(0), batch, TRIGGER=trigger, BLOCK_T=16, num_warps=4)

    def scores(mode, name, pf=1, pdl=True):
        out = torch.empty((batch, triton.cdiv(length, 64) * 64), dtype=torch.float32, device="cuda")[:, :length]
        outs[name] = out

        def fn():
            _scores_pdl[grid](q8.view(torch.uint8), w8, keys_u8, scales, token_rows, req, seq, out,
                              q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), token_rows.stride(0),
                              token_rows.stride(1), out.stride(0), 64, length, per_prog, HEADS_P=64, BLOCK_N=64,
                              MODE=mode, PF=pf, num_warps=4, num_stages=5, **({"launch_pdl": True} if mode and pdl else {}))
        return fn

    def product_fn():
        outs["product"] = F.indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq)

    wt = write_triton
    variants = {
        "torch write + product": ([write_torch], product_fn),
        "one-kernel write + product": ([lambda: wt(False)], product_fn),
        "trigger write + PDL tables early": ([lambda: wt(True)], scores(2, "m2")),
        "trigger write + PDL + L2 first keys": ([lambda: wt(True)], scores(4, "m4")),
        "trigger write + PDL + L2 1 block": ([lambda: wt(True)], scores(5, "m5a", 1)),
        "trigger write + PDL + L2 2 blocks": ([lambda: wt(True)], scores(5, "m5b", 2)),
        "trigger write + PDL + L2 4 blocks": ([lambda: wt(True)], scores(5, "m5c", 4)),
        "one-kernel write + L2 2 blocks, no PDL": ([lambda: wt(False)], scores(5, "m5n", 2, pdl=False)),
    }
    graphs = {"flush": graph_time([]), "flush+torch write": graph_time([write_torch]),
              "flush+write": graph_time([lambda: wt(False)]), "flush+trigger write": graph_time([lambda: wt(True)])}
    for name, (pred, fn) in variants.items():
        graphs[name] = graph_time(pred + [fn])
    med = replay_all(graphs)
    med2 = replay_all(graphs)  # a second round: the spread between rounds is the noise
    nbytes = batch * length * bi.BYTES_PER_POSITION
    pred_of = {"torch write + product": "flush+torch write"}
    for name, (pred, fn) in variants.items():
        base = pred_of.get(name, "flush+trigger write" if "trigger" in name else "flush+write")
        for rnd, m in (("a", med), ("b", med2)):
            add = (m[name] - m[base]) / PAIRS
            chain = (m[name] - m["flush"]) / PAIRS
            rows_out.append((batch, length, name, rnd, add, bench.fraction(nbytes, add), chain))
    for rnd, m in (("a", med), ("b", med2)):
        print(f"{batch}:{length} round {rnd}: write alone torch {(m['flush+torch write'] - m['flush']) / PAIRS:.2f} us, "
              f"one kernel {(m['flush+write'] - m['flush']) / PAIRS:.2f}, trigger {(m['flush+trigger write'] - m['flush']) / PAIRS:.2f}", flush=True)
    torch.cuda.synchronize()
    for k, o in outs.items():
        assert torch.equal(o, outs["product"]), (batch, length, k)
    print(f"{batch}:{length}: every variant's scores equal the product kernel's", flush=True)
    del graphs
    torch.cuda.empty_cache()

print("\nshape        variant                               round  scores add us  frac | write+scores us")
for b, l, name, rnd, add, frac, chain in rows_out:
    print(f"{b}:{l:<8} {name:38s} {rnd}   {add:8.2f}  {frac:6.1%} | {chain:8.2f}")
