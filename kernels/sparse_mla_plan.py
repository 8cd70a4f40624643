"""Launch planning of the sparse MLA decode that needs no GPU: the split count of the Triton kernel.

Kept apart from kernels/sparse_mla_triton.py so that it imports (and is tested) without Triton.
"""

from __future__ import annotations

import math

D_V = 512

# Cost-model constants for `choose_splits` (H200, Triton 3.6), fitted to the split sweep of
# benchmarks/bench_sparse_mla.py --splits (H 64 and 128, B 1…256, both row formats; docs/benchmarks-history.md):
# µs per BLOCK_N = 64 tile of one 64-head program (bf16 rows, FP8 rows), fixed µs per program (q load, epilogue),
# effective bandwidth of the fp32 partial outputs (written by the split programs, read back by the combine kernel;
# partly from L2), and the combine launch. FP8: 6.6 µs since its tiles are dequantized with their scale as they
# load (2026-11-28: one unsplit 32-tile program 213 µs; it was 9.5 when the scale went on the scores and P).
# The per-program 4.0 µs (2.0 before) is the value that keeps the choice nearest the best on the sweeps of both GPUs
# (2026-11-28: within 1.8 % on the H200, 5.7 % on the H100, against 3.5 % / 9.7 % with 2.0).
_TILE_US = {False: 4.2, True: 6.6}
# The Gluon kernel (kernels/sparse_mla_gluon.py, Hopper): its own tile and per-program costs, fitted to its split
# sweeps on both GPUs after its index entries moved a tile ahead (2026-11-28,
# benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28/fit_splits.py: choice within 6.7 % of the best everywhere,
# 0.2 % on average; the Triton kernel's per-program cost gave 8.9 %: the misses are batches of 1–8 at 64 heads, where
# the split count trades 2–3 µs).
_GLUON_TILE_US = {False: 2.0, True: 3.8}
_GLUON_PROGRAM_US = 2.0
_PROGRAM_US = 4.0
_PARTIAL_BYTES_PER_US = 4.0e6
_COMBINE_US = 4.0


def split_cost_us(batch: int, num_heads: int, top_k: int, block_h: int, block_n: int, num_sms: int, fp8: bool,
                  splits: int, kernel: str = "triton") -> float:
    """Modelled time of one call with `splits` splits of the top-k list.

    Programs run in waves of `num_sms · per_sm` (a 64-head program fills an SM's shared memory); a program
    streams `top_k / splits / block_n` tiles. Splitting fills idle SMs but every split beyond one writes an fp32
    partial output [block_h, 512] that the combine kernel reads back, plus the combine launch: at large batch
    this traffic (2 · B · H · splits · 2 KiB) costs more than the tiles it parallelizes.
    """
    tiles = top_k // block_n
    programs = batch * (num_heads // block_h) * splits
    per_sm = 1 if block_h >= 64 else 2
    waves = math.ceil(programs / (num_sms * per_sm))
    gluon = kernel == "gluon"
    tile_us = (_GLUON_TILE_US if gluon else _TILE_US)[fp8] * block_h / 64 * block_n / 64
    cost = waves * (tiles // splits * tile_us + (_GLUON_PROGRAM_US if gluon else _PROGRAM_US))
    if splits > 1:
        cost += 2 * batch * num_heads * splits * D_V * 4 / _PARTIAL_BYTES_PER_US + _COMBINE_US
    return cost


def choose_splits(batch: int, num_heads: int, top_k: int, block_h: int, block_n: int, num_sms: int,
                  fp8: bool = False, kernel: str = "triton") -> int:
    """Split count of the top-k list, a function of shapes only (so results never depend on slot placement):
    the divisor of the tile count with the least `split_cost_us` (the smallest on ties). `kernel`: "triton" or
    "gluon" (their tile costs differ)."""
    if kernel not in ("triton", "gluon"):
        raise ValueError(f"unknown sparse MLA kernel {kernel!r}")
    tiles = top_k // block_n
    best, best_cost = 1, math.inf
    for s in range(1, tiles + 1):
        if tiles % s:
            continue
        cost = split_cost_us(batch, num_heads, top_k, block_h, block_n, num_sms, fp8, s, kernel)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


# Smallest batch from which FlashMLA beats our own kernel, per (heads, FP8 rows), K = 2048
# (benchmarks/bench_sparse_mla.py --flashmla). On Hopper our kernel is the Gluon one; measured on both GPUs
# (2026-11-28, benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28, Gluon µs vs FlashMLA µs, H200 / H100):
# bf16 H128 B 32: 65.8 / 69.2 vs 68.4 / 71.8, B 40: 104.7 / 107.2 vs 69.9 / 73.4; bf16 H64 B 64: 68.1 / 81.0 vs
# 71.6 / 81.6, B 80: 106.6 / 109.3 vs 75.3 / 91.5. The step is where two splits of every request stop fitting one
# wave of 132 SMs (B 33 at 128 heads, 66 at 64): above it each program streams the whole top-k list, so the bf16
# thresholds sit there. FP8 H128 B 1: 18.0 / 19.3 vs 20.7 / 21.8, B 2: FlashMLA ahead on both; FP8 H64 B 3: Gluon
# ahead on the H200, FlashMLA by 0.4 % on the H100, B 4: FlashMLA ahead on both. FlashMLA's bf16 kernel is its
# sparse prefill kernel: ~57 µs even for one query.
FLASHMLA_MIN_BATCH: dict[tuple[int, bool], int] = {(128, True): 2, (128, False): 34, (64, True): 4, (64, False): 67}


def prefer_flashmla(batch: int, num_heads: int, fp8: bool) -> bool:
    """Whether the `flashmla` attention backend runs FlashMLA (rather than our own kernel) for this launch shape.
    Depends only on shapes, so dense and HiSparse (same batch) always pick the same kernel."""
    threshold = FLASHMLA_MIN_BATCH.get((num_heads, fp8))
    return threshold is not None and batch >= threshold
