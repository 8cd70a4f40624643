"""Benchmark of the Triton sparse MLA decode against the PyTorch reference (same run, same inputs).

Cases: B 1/16/64/128, H 16/64/128, K 2048, bf16 rows (1152 B) and FP8 rows (656 B). Work per request:
2·H·K·(576+512) FLOPs; bytes: the selected KV rows (B·K·row bytes, selections are random so nearly all
distinct) + q + out. Rows are drawn from a 1 M-row pool; triton.testing.do_bench flushes the L2 between
calls (untimed) and the calls rotate over several index sets; CUDA events around each call, the host
enqueueing behind a GPU spin so that launch overhead is not counted. `--configs` also times alternative block sizes for the
B=64, H=128 case.

    PYTHONPATH=$PWD python3 benchmarks/bench_sparse_mla.py [--quick] [--configs] [--json out.json]
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

from kernels.dispatch import sparse_mla_decode_rows_ref  # noqa: E402
from kernels.fp8_rows import pack_fp8_rows  # noqa: E402
from kernels.sparse_mla_triton import default_config, sparse_mla_decode_triton  # noqa: E402

logger = logging.getLogger("bench_sparse_mla")
POOL_ROWS = 1 << 20
SCALE = 0.135234


@dataclass
class Result:
    fmt: str
    batch: int
    heads: int
    top_k: int
    config: str
    us: float
    tflops: float
    gbps: float
    ref_us: float
    speedup_vs_ref: float
    rel_err: float


def make_pool(fmt: str) -> torch.Tensor:
    rows = torch.empty((POOL_ROWS, 576), dtype=torch.bfloat16, device="cuda").normal_()
    if fmt == "bf16":
        return rows
    out = torch.empty((POOL_ROWS, 656), dtype=torch.uint8, device="cuda")
    for start in range(0, POOL_ROWS, 1 << 16):
        out[start : start + (1 << 16)] = pack_fp8_rows(rows[start : start + (1 << 16)])
    return out


def bench(fn, rotations: int, flush: torch.Tensor) -> float:
    """Median GPU µs per call, rotating over input sets and flushing the L2 (untimed) before each call."""
    state = {"i": 0}

    def reset() -> None:
        state["i"] = (state["i"] + 1) % rotations
        flush.zero_()

    return time_gpu_us(lambda: fn(state["i"]), reset=reset, warmup=3, iters=20)


def run_case(pool: torch.Tensor, fmt: str, batch: int, heads: int, top_k: int, config: dict | None,
             with_ref: bool, rotations: int = 4) -> Result:
    qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(rotations)]
    idx = [torch.randint(0, POOL_ROWS, (batch, top_k), device="cuda", dtype=torch.int32) for _ in range(rotations)]
    out, _ = sparse_mla_decode_triton(qs[0], pool, idx[0], SCALE, config)
    ref, _ = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
    rel_err = float((out.float() - ref.float()).norm() / ref.float().norm())
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    us = bench(lambda i: sparse_mla_decode_triton(qs[i], pool, idx[i], SCALE, config), rotations, flush)
    ref_us = bench(lambda i: sparse_mla_decode_rows_ref(qs[i], pool, idx[i], SCALE), rotations, flush) if with_ref else 0.0
    flops = 2.0 * batch * heads * top_k * (576 + 512)
    row_bytes = pool.shape[1] * pool.element_size()
    nbytes = batch * top_k * row_bytes + batch * heads * (576 + 512) * 2
    cfg = config or default_config(heads, fmt == "fp8")
    cfg_s = f"H{cfg['BLOCK_H']}/N{cfg['BLOCK_N']}/w{cfg['num_warps']}/s{cfg['num_stages']}" + (
        "/wide" if cfg.get("WIDE") else "")
    return Result(fmt, batch, heads, top_k, cfg_s, us, flops / (us * 1e-6) / 1e12, nbytes / (us * 1e-6) / 1e9,
                  ref_us, ref_us / us if with_ref else 0.0, rel_err)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", action="store_true", help="also time alternative block sizes at B=64 H=128")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    top_k = 2048
    batches = [1, 16, 64, 128] if not args.quick else [1, 64]
    heads_list = [16, 64, 128]
    results: list[Result] = []
    for fmt in ("bf16", "fp8"):
        pool = make_pool(fmt)
        for heads in heads_list:
            for batch in batches:
                r = run_case(pool, fmt, batch, heads, top_k, None, with_ref=True)
                results.append(r)
                logger.info("%s B %3d H %3d: %8.1f us %6.1f TFLOP/s %7.1f GB/s | ref %9.1f us (x%.1f) | err %.1e",
                            fmt, batch, heads, r.us, r.tflops, r.gbps, r.ref_us, r.speedup_vs_ref, r.rel_err)
        if args.configs:
            for cfg in ({"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
                        {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
                        {"BLOCK_H": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                        {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "WIDE": 1},
                        {"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2, "WIDE": 1},
                        {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "WIDE": 1}):
                if cfg.get("WIDE") and fmt == "fp8":
                    continue
                try:
                    r = run_case(pool, fmt, 64, 128, top_k, cfg, with_ref=False)
                except Exception as exc:  # a config the compiler rejects (e.g. out of shared memory)
                    logger.info("%s config %s failed: %s", fmt, cfg, str(exc).splitlines()[0][:200])
                    continue
                results.append(r)
                logger.info("%s B 64 H 128 %s: %8.1f us %6.1f TFLOP/s err %.1e", fmt, r.config, r.us, r.tflops,
                            r.rel_err)
        del pool
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps({"device": device_name(), "results": [asdict(r) for r in results]}, indent=1))
    print(f"\nsparse MLA decode, K={top_k}, {device_name()}")
    print("| rows | B | H | config | us | TFLOP/s | GB/s | ref us | speed-up | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.fmt} | {r.batch} | {r.heads} | {r.config} | {r.us:.1f} | {r.tflops:.1f} | {r.gbps:.0f} | "
              f"{r.ref_us:.0f} | {r.speedup_vs_ref:.0f} | {r.rel_err:.1e} |")


if __name__ == "__main__":
    main()
