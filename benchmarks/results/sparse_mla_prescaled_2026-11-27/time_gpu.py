"""For the next GPU session (issue 23 item 6): FlashMLA, the current Triton kernel and the prescaled variant
(`mla_prescaled.py`, SCALE_IN 0 and 1) on the same inputs, 128 heads, K 2048, B 64 and 128, bf16 and FP8 rows; L2
flushed before every call (bench_sparse_mla.bench); each output against the float reference. Prints one table:
µs and the FlashMLA / kernel time ratio (issue 23's target: ≥ 0.6 at B 64).

    PYTHONPATH=$PWD python3 benchmarks/results/sparse_mla_prescaled_2026-11-27/time_gpu.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, "benchmarks")
from bench_sparse_mla import POOL_ROWS, SCALE, bench, make_pool  # noqa: E402
from mla_prescaled import sparse_mla_prescaled  # noqa: E402

from kernels.dispatch import sparse_mla_decode_rows_ref  # noqa: E402
from kernels.sparse_mla_flashmla import flashmla_applies, sparse_mla_decode_flashmla  # noqa: E402
from kernels.sparse_mla_triton import sparse_mla_decode_triton  # noqa: E402

HEADS, TOP_K = 128, 2048


def case(pool: torch.Tensor, fmt: str, batch: int, flush: torch.Tensor) -> dict[str, float]:
    """µs of each kernel at one (rows, batch), printing each output's error against the float reference."""
    qs = [torch.randn(batch, HEADS, 576, device="cuda").bfloat16() for _ in range(2)]
    idx = [torch.randint(0, POOL_ROWS, (batch, TOP_K), device="cuda", dtype=torch.int32) for _ in range(2)]
    ref, _ = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
    kernels = {"triton": lambda q, ix: sparse_mla_decode_triton(q, pool, ix, SCALE)}
    if flashmla_applies(qs[0], pool, idx[0]):
        kernels["flashmla"] = lambda q, ix: sparse_mla_decode_flashmla(q, pool, ix, SCALE)
    for scale_in in (0, 1) if fmt == "fp8" else (0,):
        kernels[f"prescaled {scale_in}"] = lambda q, ix, s=scale_in: sparse_mla_prescaled(q, pool, ix, SCALE,
                                                                                         scale_in=s)
    times = {}
    for name, fn in kernels.items():
        out, _ = fn(qs[0], idx[0])
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        times[name] = bench(lambda i, fn=fn: fn(qs[i], idx[i]), 2, flush)
        print(f"{fmt} B {batch} {name}: {times[name]:.1f} us, rel err {err:.2e}", flush=True)
    return times


def main() -> None:
    torch.manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    table = []
    for fmt in ("bf16", "fp8"):
        pool = make_pool(fmt)
        table += [(fmt, batch, case(pool, fmt, batch, flush)) for batch in (64, 128)]
        del pool
        torch.cuda.empty_cache()
    print("\n| rows | B | kernel | µs | FlashMLA / kernel |")
    for fmt, batch, times in table:
        for name, us in times.items():
            ratio = times["flashmla"] / us if "flashmla" in times else float("nan")
            print(f"| {fmt} | {batch} | {name} | {us:.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
