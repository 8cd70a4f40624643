# ruff: noqa  -- kept as it ran (from bench_tmp/balanced.py), 2026-11-28; lambdas are timed within their iteration
"""Experiment (issue 23 item 1): the indexer's scores kernel over an even split of the batch's position blocks
(a plan made once a forward, like DeepGEMM's schedule metadata) against the product kernel's per-query spans
(sized for the longest row), with equal and with mixed lengths. Same per-position work, so the same score bits
(checked). --smoke: the bit check on CPU under Triton's interpreter.

    PYTHONPATH=$PWD python3 bench_tmp/balanced.py [--smoke]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
sys.path.insert(0, str(Path.cwd()))
SMOKE = "--smoke" in sys.argv
if SMOKE:
    from kernels import triton_interpret

    triton_interpret.enable()
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernels.indexer_fast import (  # noqa: E402
    DEFAULT_CONFIG,
    _RESIDENT,
    indexer_scores_fast,
    quantize_query,
)


@triton.jit(do_not_specialize=["max_len", "stride_rows_b"])
def _balanced_kernel(
    q_ptr, w_ptr, keys_ptr, scales_ptr, rows_ptr, req_ptr, lens_ptr, out_ptr, plan_ptr,
    stride_qt, stride_qh, stride_wt, stride_keys, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program per plan entry (first query, first block in it, blocks, segments): its blocks run through
    one or more queries' rows in order; per segment (query) the product kernel's loop (e4m3 q), same bits."""
    p = tl.program_id(0)
    t = tl.load(plan_ptr + p * 4).to(tl.int64)
    b = tl.load(plan_ptr + p * 4 + 1)
    remaining = tl.load(plan_ptr + p * 4 + 2)
    segments = tl.load(plan_ptr + p * 4 + 3)
    heads = tl.arange(0, HEADS_P)
    dims = tl.arange(0, 128)
    offs = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads
    for _s in range(0, segments):
        req = tl.load(req_ptr + t).to(tl.int64)
        seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
        blocks_t = (seq_len + BLOCK_N - 1) // BLOCK_N
        nb = tl.minimum(blocks_t - b, remaining)
        start = b * BLOCK_N
        scored_end = tl.minimum(start + nb * BLOCK_N, seq_len)
        row_base = rows_ptr + req * stride_rows_b
        pos_next = start + offs
        rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=pos_next < scored_end, other=-1).to(tl.int64)
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        out_base = out_ptr + t * stride_out
        scale_next = tl.load(scales_ptr + rows_next, mask=(pos_next < scored_end) & (rows_next >= 0), other=0.0)
        for i in range(0, nb):
            pos = start + i * BLOCK_N + offs
            visible = pos < scored_end
            rows = tl.load(row_base + pos * stride_rows_l, mask=visible, other=-1).to(tl.int64)
            valid = visible & (rows >= 0)
            key_scale = scale_next
            pos_next = pos + BLOCK_N
            ahead = pos_next < scored_end
            rows_next = tl.load(row_base + pos_next * stride_rows_l, mask=ahead, other=-1).to(tl.int64)
            scale_next = tl.load(scales_ptr + rows_next, mask=ahead & (rows_next >= 0), other=0.0)
            raw = tl.load(keys_ptr + rows[:, None] * stride_keys + dims[None, :], mask=valid[:, None], other=0)
            logits = tl.dot(raw.to(tl.float8e4nv, bitcast=True), q_op)
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
            tl.store(out_base + pos, score, mask=visible)
        remaining -= nb
        t += 1
        b = b * 0


def make_plan(seq_lens: torch.Tensor, max_len: int, block_n: int, programs: int) -> torch.Tensor:
    """[programs, 4] int32 (first query, first block in it, blocks, segments): the batch's blocks split evenly in
    query order. Device ops only (no host sync): made once a forward in an engine."""
    blocks = (seq_lens.clamp(max=max_len).to(torch.int64) + block_n - 1) // block_n
    ends = torch.cumsum(blocks, 0)
    total = ends[-1]
    g = torch.arange(programs + 1, device=seq_lens.device, dtype=torch.int64) * total // programs
    g0, g1 = g[:-1], g[1:]
    n = g1 - g0
    last = seq_lens.shape[0] - 1
    t0 = torch.searchsorted(ends, g0, right=True).clamp(max=last)
    b0 = g0 - (ends[t0] - blocks[t0])
    t1 = torch.searchsorted(ends, (g1 - 1).clamp(min=0), right=True).clamp(max=last)
    segments = torch.where(n > 0, t1 - t0 + 1, 0)
    return torch.stack([t0, b0, n, segments], dim=1).to(torch.int32).contiguous()


def scores_balanced(q8, w8, keys, scales, token_rows, req, seq, plan, out=None):
    num_q, heads, _ = q8.shape
    max_len = token_rows.shape[1]
    padded = triton.cdiv(max(max_len, 1), 64) * 64
    if out is None:
        out = torch.empty((num_q, padded), dtype=torch.float32, device=q8.device)[:, :max_len]
    cfg = DEFAULT_CONFIG
    _balanced_kernel[(plan.shape[0],)](
        q8.view(torch.uint8), w8, keys.view(torch.uint8), scales, token_rows, req, seq, out, plan,
        q8.stride(0), q8.stride(1), w8.stride(0), keys.stride(0), token_rows.stride(0), token_rows.stride(1),
        out.stride(0), heads, max_len,
        HEADS_P=max(16, triton.next_power_of_2(heads)), BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def same_scores(a: torch.Tensor, b: torch.Tensor, seq: torch.Tensor) -> bool:
    for t, n in enumerate(seq.tolist()):
        if not torch.equal(a[t, :n], b[t, :n]):
            return False
    return True


def smoke() -> None:
    from kernels.indexer_ref import quantize_index_keys

    gen = torch.Generator().manual_seed(0)
    rows_total, heads, max_len = 4096, 16, 640
    keys, scales = quantize_index_keys(torch.randn(rows_total, 128, generator=gen))
    for lens in ([640, 0, 37, 640, 129], [1, 1, 640], [0, 0, 5], [640]):
        batch = len(lens)
        token_rows = torch.randperm(rows_total, generator=gen)[: batch * max_len].view(batch, max_len).int()
        token_rows[0, 3] = -1  # an unfilled row id
        seq = torch.tensor(lens, dtype=torch.int64)
        req = torch.arange(batch)
        q8, w8 = quantize_query(torch.randn(batch, heads, 128, generator=gen), torch.randn(batch, heads, generator=gen))
        ref = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq)
        for programs in (1, 3, 7, 40):
            plan = make_plan(seq, max_len, 64, programs)
            assert int(plan[:, 2].sum()) == sum((min(n, max_len) + 63) // 64 for n in lens)
            got = scores_balanced(q8, w8, keys, scales, token_rows, req, seq, plan)
            assert same_scores(got, ref, seq), (lens, programs)
    print("smoke: balanced == product on every visible position (4 batches x 4 program counts)")


def gpu() -> None:
    from bench_indexer import BYTES_PER_POSITION, Bench, hbm_copy_gbps

    bench = Bench(argparse.Namespace(layout="paged", flush="read", json=None))
    copy = bench.report.hbm_copy_gbps = hbm_copy_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()} copy {copy:.0f} GB/s", flush=True)
    keys, scales = bench.keys, bench.scales
    table = []
    cases = [(16, 32768, "equal"), (16, 65536, "equal"), (64, 32768, "equal"), (64, 131072, "equal"),
             (16, 32768, "mixed"), (64, 32768, "mixed"), (64, 131072, "mixed")]
    for batch, length, kind in cases:
        q, w, _, _, token_rows, req, seq = bench.inputs(batch, length, batch * 7 + length)
        if kind == "mixed":  # lengths uniform in [L/8, L]
            gen = torch.Generator(device="cuda").manual_seed(batch + length)
            seq = torch.randint(length // 8, length + 1, (batch,), device="cuda", generator=gen)
        q8, w8 = quantize_query(q, w)
        product = indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq)
        resident = next((v for k, v in _RESIDENT.items() if k[2]), 5)
        row = {"B": batch, "L": length, "kind": kind, "resident": resident}
        nbytes = int(seq.sum()) * BYTES_PER_POSITION
        row["product"] = bench.graph_us(lambda: indexer_scores_fast(q8, w8, keys, scales, token_rows, req, seq))
        for per_sm in (resident, resident - 1, 2 * resident):
            plan = make_plan(seq, length, 64, per_sm * sms)
            got = scores_balanced(q8, w8, keys, scales, token_rows, req, seq, plan)
            torch.cuda.synchronize()
            row[f"same_{per_sm}"] = same_scores(got, product, seq)
            out = torch.empty_like(got)
            row[f"balanced_{per_sm}"] = bench.graph_us(
                lambda plan=plan, out=out: scores_balanced(q8, w8, keys, scales, token_rows, req, seq, plan, out))
        row["plan_us"] = bench.graph_us(lambda: make_plan(seq, length, 64, resident * sms))
        row["frac"] = {k: bench.fraction(nbytes, v) for k, v in row.items() if k.startswith(("product", "balanced"))}
        table.append(row)
        print(row, flush=True)
    print("\nus in a replayed graph after an L2 flush (fraction of the copy's rate, bytes = sum of lengths x 140)")
    for r in table:
        cells = "  ".join(f"{k} {r[k]:6.1f} ({r['frac'][k]:5.1%})" for k in r["frac"])
        same = all(v for k, v in r.items() if k.startswith("same_"))
        print(f"{r['B']:3d} {r['L']:7d} {r['kind']:5s} | {cells} | plan {r['plan_us']:.1f} | same bits {same}")


if __name__ == "__main__":
    smoke() if SMOKE else gpu()
