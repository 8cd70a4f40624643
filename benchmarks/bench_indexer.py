"""Benchmark of the lightning-indexer top-k: Triton scores kernel + torch.topk against the old pure-torch path
(kernels/indexer_gpu.indexer_topk_torch), same run, same inputs.

Cases: B (one decode query per request) in {1, 64, 237}, context L in {8192, 32768, 65536}, 64 indexer heads
× 128, top-k 2048, every query seeing its whole context. Key rows are random rows of a shared FP8 pool of
237·65536 rows (2 GiB), so every key read is a gather; the L2 is flushed (untimed) before each timed call.
Reported per case: scores kernel, torch.topk (sorted) and topk(sorted=False)+sort, the whole new call, the old
call (skipped where it runs out of memory); useful TFLOP/s = 2·B·L·H·128 / scores time; GB/s = the bytes the
scores kernel must read (B·L·(128 B key + 4 B scale + 4 B row id)) / scores time; overlap of the selected sets
with the old path's (fp32) selection; score error: largest |score − fp64 score| / max |fp64 score| over the
first 8 queries. `--configs` also times other launch shapes of the kernel for B=237,
L=32768.

    PYTHONPATH=$PWD python3 benchmarks/bench_indexer.py [--configs] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, time_gpu_us  # noqa: E402

from kernels.indexer_gpu import indexer_topk_torch  # noqa: E402
from kernels.indexer_ref import quantize_index_keys  # noqa: E402
from kernels.indexer_triton import ScoresConfig, indexer_scores_triton, indexer_topk_triton  # noqa: E402

logger = logging.getLogger("bench_indexer")
HEADS = 64
TOP_K = 2048
BATCHES = (1, 64, 237)
LENGTHS = (8192, 32768, 65536)
POOL_ROWS = max(BATCHES) * max(LENGTHS)
BYTES_PER_POSITION = 128 + 4 + 4


@dataclass
class Result:
    batch: int
    length: int
    scores_us: float
    topk_us: float
    topk_unsorted_sort_us: float
    new_us: float
    old_us: float | None
    tflops: float
    gbps: float
    speedup: float | None
    overlap_mean: float | None
    overlap_min: float | None
    score_err: float


def make_pool() -> tuple[torch.Tensor, torch.Tensor]:
    keys = torch.empty((POOL_ROWS, 128), dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.empty(POOL_ROWS, dtype=torch.float32, device="cuda")
    step = 1 << 20
    for start in range(0, POOL_ROWS, step):
        end = min(POOL_ROWS, start + step)
        keys[start:end], scales[start:end] = quantize_index_keys(torch.randn(end - start, 128, device="cuda"))
    return keys, scales


def topk_unsorted_then_sort(scores: torch.Tensor) -> torch.Tensor:
    values, idx = torch.topk(scores, TOP_K, dim=1, sorted=False)
    return idx.gather(1, values.argsort(dim=1, descending=True, stable=True))


def score_error(scores: torch.Tensor, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                scales: torch.Tensor, token_rows: torch.Tensor, *_: torch.Tensor, queries: int = 8) -> float:
    """Largest |score − fp64 score| / max |fp64 score| over the first `queries` queries (full context)."""
    worst = 0.0
    for t in range(min(queries, scores.shape[0])):
        rows = token_rows[t].long()
        exact = torch.einsum("hd,nd->hn", q[t].double(), keys[rows].double()).relu()
        exact = (w[t].double() @ exact) * scales[rows].double()
        worst = max(worst, float((scores[t].double() - exact).abs().max() / exact.abs().max()))
    return worst


def overlap(a: torch.Tensor, b: torch.Tensor, length: int) -> tuple[float, float]:
    """Mean and min over queries of |set(a) ∩ set(b)| / top_k."""
    ma = torch.zeros((a.shape[0], length), dtype=torch.bool, device=a.device)
    mb = torch.zeros_like(ma)
    ma.scatter_(1, a.long(), True)
    mb.scatter_(1, b.long(), True)
    frac = (ma & mb).sum(dim=1).float() / TOP_K
    return float(frac.mean()), float(frac.min())


def run_case(keys: torch.Tensor, scales: torch.Tensor, batch: int, length: int, flush: torch.Tensor,
             with_old: bool) -> Result:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + length)
    token_rows = torch.randperm(POOL_ROWS, device="cuda", generator=gen)[: batch * length]
    token_rows = token_rows.to(torch.int32).reshape(batch, length)
    token_req = torch.arange(batch, device="cuda")
    seq_lens = torch.full((batch,), length, device="cuda", dtype=torch.int64)
    q = torch.randn(batch, HEADS, 128, device="cuda", generator=gen)
    w = torch.randn(batch, HEADS, device="cuda", generator=gen) * HEADS**-0.5
    args = (q, w, keys, scales, token_rows, token_req, seq_lens)

    def reset() -> None:
        flush.zero_()

    scores = indexer_scores_triton(*args)
    err = score_error(scores, *args)
    scores_us = time_gpu_us(lambda: indexer_scores_triton(*args), reset=reset)
    topk_us = time_gpu_us(lambda: torch.topk(scores, TOP_K, dim=1, sorted=True), reset=reset)
    alt_us = time_gpu_us(lambda: topk_unsorted_then_sort(scores), reset=reset)
    new = indexer_topk_triton(*args, TOP_K)
    new_us = time_gpu_us(lambda: indexer_topk_triton(*args, TOP_K), reset=reset)
    old_us = overlap_mean = overlap_min = None
    if with_old:
        try:
            old = indexer_topk_torch(*args, TOP_K)
            old_us = time_gpu_us(lambda: indexer_topk_torch(*args, TOP_K), reset=reset, warmup=1, iters=5)
            overlap_mean, overlap_min = overlap(new, old, length)
        except torch.OutOfMemoryError:
            logger.warning("old path out of memory at B=%d L=%d: skipped", batch, length)
        torch.cuda.empty_cache()
    flops = 2.0 * batch * length * HEADS * 128
    return Result(
        batch=batch, length=length, scores_us=scores_us, topk_us=topk_us, topk_unsorted_sort_us=alt_us,
        new_us=new_us, old_us=old_us, tflops=flops / (scores_us * 1e-6) / 1e12,
        gbps=batch * length * BYTES_PER_POSITION / (scores_us * 1e-6) / 1e9,
        speedup=old_us / new_us if old_us else None, overlap_mean=overlap_mean, overlap_min=overlap_min,
        score_err=err,
    )


def sweep_configs(keys: torch.Tensor, scales: torch.Tensor,
                  flush: torch.Tensor) -> list[tuple[str, float, float]]:
    """Scores-kernel time and score error of other launch shapes at B=237, L=32768."""
    batch, length = 237, 32768
    gen = torch.Generator(device="cuda").manual_seed(1)
    token_rows = torch.randperm(POOL_ROWS, device="cuda", generator=gen)[: batch * length]
    args = (torch.randn(batch, HEADS, 128, device="cuda", generator=gen),
            torch.randn(batch, HEADS, device="cuda", generator=gen), keys, scales,
            token_rows.to(torch.int32).reshape(batch, length), torch.arange(batch, device="cuda"),
            torch.full((batch,), length, device="cuda", dtype=torch.int64))
    configs = [ScoresConfig()] + [
        ScoresConfig(block_n=bn, num_warps=nw, num_stages=ns, fp16=f16, heads_as_m=hm, blocks_per_program=bpp)
        for bn, nw, ns, f16, hm, bpp in [
            (64, 4, 3, False, False, None), (128, 4, 2, False, False, None), (64, 4, 4, True, False, None),
            (128, 8, 3, True, False, None), (32, 4, 3, True, False, None), (64, 4, 3, True, True, None),
            (128, 4, 3, True, True, None), (128, 8, 3, True, True, None), (64, 8, 3, True, True, None),
            (64, 4, 3, True, False, 8), (64, 4, 3, True, False, 64),
        ]
    ]
    out = []
    for cfg in configs:
        try:
            err = score_error(indexer_scores_triton(*args, config=cfg), *args)
            us = time_gpu_us(lambda cfg=cfg: indexer_scores_triton(*args, config=cfg), reset=flush.zero_)
        except Exception as exc:  # a launch shape the compiler rejects (e.g. out of shared memory)
            logger.warning("config %s failed: %s", cfg, exc)
            us = err = float("nan")
        out.append((str(cfg), us, err))
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", action="store_true", help="also time other kernel launch shapes")
    parser.add_argument("--no-old", action="store_true", help="skip the old pure-torch path")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    keys, scales = make_pool()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results = []
    for batch in BATCHES:
        for length in LENGTHS:
            res = run_case(keys, scales, batch, length, flush, with_old=not args.no_old)
            logger.info("%s", res)
            results.append(res)
    sweep = sweep_configs(keys, scales, flush) if args.configs else []
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(), "results": [asdict(r) for r in results],
                                         "configs": sweep}, indent=1))
    for cfg, us, err in sweep:
        print(f"config {cfg}: scores {us:.1f} us, score error {err:.2e}")
    print(f"\nLightning indexer, {device_name()}: H={HEADS}, top-k {TOP_K}, times in us (median, L2 flushed)")
    print(f"{'B':>4} {'L':>6} | {'scores':>8} {'TFLOP/s':>8} {'GB/s':>7} | {'topk':>8} {'tk+sort':>8} | "
          f"{'new':>8} {'old':>9} {'speedup':>7} | {'overlap mean/min':>16} | score err")
    for r in results:
        old = f"{r.old_us:9.0f}" if r.old_us else f"{'-':>9}"
        speed = f"{r.speedup:7.1f}" if r.speedup else f"{'-':>7}"
        ov = f"{r.overlap_mean:.4f}/{r.overlap_min:.4f}" if r.overlap_mean is not None else "-"
        print(f"{r.batch:4d} {r.length:6d} | {r.scores_us:8.1f} {r.tflops:8.1f} {r.gbps:7.0f} | {r.topk_us:8.1f} "
              f"{r.topk_unsorted_sort_us:8.1f} | {r.new_us:8.1f} {old} {speed} | {ov:>16} | {r.score_err:.1e}")


if __name__ == "__main__":
    main()
