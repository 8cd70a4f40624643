"""Launch-shape sweep of the indexer's top-k kernel (kernels/topk_triton.py) on the GPU, with torch.topk as the
baseline in the same run.

For every (B, L) case: random normal fp32 scores [B, L] (every row visible), top-k 2048; the CUDA kernel
(kernels/topk_cuda.py), the Triton kernel at its default launch and a 2048-score scan block (`--sweep`: every
warps × scan block), each checked equal to the Triton default's positions, and torch.topk
(sorted and unsorted) for scale. Timing as benchmarks/bench_indexer.py (CUDA events, the host behind a
GPU spin, median of 20 after 3 warm-ups, L2 flushed before every call). A table per case, fastest first, and one
JSON with every row.

    PYTHONPATH=$PWD python3 benchmarks/tune_topk.py [--batches 1 64 128] [--lengths 32768 131072] [--sweep]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _timing import device_name, time_gpu_us  # noqa: E402

from kernels.topk_cuda import topk_positions_cuda  # noqa: E402
from kernels.topk_triton import topk_positions_triton  # noqa: E402

logger = logging.getLogger("tune_topk")
TOP_K = 2048
WARPS = (8, 16, 32)
BLOCKS = (2048, 4096, 8192)


def run_case(batch: int, length: int, flush: torch.Tensor, sweep: bool) -> list[dict]:
    """One (B, L) case: every kernel variant and torch.topk on the same random rows."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + length)
    scores = torch.randn(batch, length, device="cuda", generator=gen)
    seq = torch.full((batch,), length, device="cuda")
    reference = topk_positions_triton(scores, seq, TOP_K)
    variants: dict[str, Callable[[], torch.Tensor]] = {
        "torch.topk sorted": lambda: torch.topk(scores, TOP_K, dim=1).indices,
        "torch.topk unsorted": lambda: torch.topk(scores, TOP_K, dim=1, sorted=False).indices,
        "cuda": lambda: topk_positions_cuda(scores, seq, TOP_K),
    }
    shapes = itertools.product(WARPS, BLOCKS) if sweep else [(16, 4096), (16, 2048)]
    for warps, block in shapes:
        variants[f"triton w{warps} b{block}"] = functools.partial(
            topk_positions_triton, scores, seq, TOP_K, num_warps=warps, scan_block=block)
    case = []
    for name, call in variants.items():
        try:
            same = name.startswith("torch") or bool(torch.equal(call(), reference))
            us = time_gpu_us(call, reset=flush.zero_)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a result, not a stop
            logger.warning("B %d L %d %s failed: %s", batch, length, name, exc)
            continue
        case.append({"kernel": name, "us": us, "same": same, "batch": batch, "length": length})
    baseline = case[0]["us"]
    for entry in case:
        entry["vs_torch_sorted"] = baseline / entry["us"]
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--sweep", action="store_true", help="every warps × scan block of the Triton kernel")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows: list[dict] = []
    print(f"top-k {TOP_K} on {device_name()}: us (speed-up over torch.topk sorted), fastest first")
    for batch, length in itertools.product(args.batches, args.lengths):
        case = run_case(batch, length, flush, args.sweep)
        rows.extend(case)
        line = "  ".join(f"{e['kernel']} {e['us']:.1f} ({e['vs_torch_sorted']:.2f}x)"
                         f"{'' if e['same'] else ' DIFFERENT'}" for e in sorted(case, key=lambda e: e["us"])[:6])
        print(f"B {batch:>3} L {length:>6}: {line}")
        if args.json:
            args.json.write_text(json.dumps({"device": device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
