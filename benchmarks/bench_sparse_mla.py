"""Benchmark of the Triton sparse MLA decode against the PyTorch reference (same run, same inputs).

Cases: B 1/16/64/128, H 16/64/128, K 2048, bf16 rows (1152 B) and FP8 rows (656 B). Work per request:
2·H·K·(576+512) FLOPs; bytes: the selected KV rows (B·K·row bytes, selections are random so nearly all
distinct) + q + out. Rows are drawn from a 1 M-row pool; triton.testing.do_bench flushes the L2 between
calls (untimed) and the calls rotate over several index sets; CUDA events around each call, the host
enqueueing behind a GPU spin so that launch overhead is not counted. `--configs` also times alternative block sizes for the
B=64, H=128 case.

`--splits` sweeps the Triton kernel's split count (every divisor of the 32 tiles) at B 1…256, H 128 and 64, both
row formats, and prints the split `choose_splits` picks against the fastest (target: within 5 %);
`--splits-gluon` the same sweep for the Gluon kernel (kernels/sparse_mla_gluon.py, Hopper). `--flashmla` times FlashMLA (the
`sgl-flash-mla` wheel: FP8 rows through its sparse decode kernel, bf16 rows through its sparse prefill kernel) on
the same inputs, with its error against the reference, next to the Triton kernel's chosen split and, on Hopper,
the Gluon kernel's (the `triton` backend's kernel there).

`--tp-heads` times a tensor-parallel rank's 16 / 32 heads through the Triton kernel and the Gluon kernel padded to
64 heads, and checks that `sparse_mla_decode` runs the kernel `gluon_takes_heads` names.

    PYTHONPATH=$PWD python3 benchmarks/bench_sparse_mla.py [--quick] [--configs] [--splits] [--splits-gluon] [--flashmla]
        [--tp-heads] [--json out.json]
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
from kernels.sparse_mla_gluon import gluon_applies, sparse_mla_decode_gluon  # noqa: E402
from kernels.sparse_mla_plan import choose_splits  # noqa: E402
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


SWEEP_BATCHES = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32, 40, 48, 50, 64, 80, 96, 128, 160, 192, 237, 256]


def _forced_split(kernel: str, pool: torch.Tensor, splits: int, cfg0: dict):
    """The kernel's call with a forced split count."""
    if kernel == "gluon":
        return lambda q, ix: sparse_mla_decode_gluon(q, pool, ix, SCALE, splits=splits)
    cfg = dict(cfg0, SPLITS=splits)
    return lambda q, ix: sparse_mla_decode_triton(q, pool, ix, SCALE, cfg)


def split_sweep(pool: torch.Tensor, fmt: str, heads: int, top_k: int, batches: list[int],
                kernel: str = "triton") -> list[dict]:
    """Time every split count at each batch; report the chosen one against the best."""
    rows = []
    cfg0 = default_config(heads, fmt == "fp8")
    tiles = top_k // cfg0["BLOCK_N"]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for batch in batches:
        qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, top_k), device="cuda", dtype=torch.int32) for _ in range(2)]
        times = {}
        for s in (d for d in range(1, tiles + 1) if tiles % d == 0):
            call = _forced_split(kernel, pool, s, cfg0)
            times[s] = bench(lambda i, f=call, q=qs, ix=idx: f(q[i], ix[i]), 2, flush)
        chosen = choose_splits(batch, heads, top_k, cfg0["BLOCK_H"], cfg0["BLOCK_N"],
                               torch.cuda.get_device_properties(0).multi_processor_count, fmt == "fp8", kernel)
        best = min(times, key=times.get)
        row = {"kernel": kernel, "fmt": fmt, "heads": heads, "batch": batch, "times_us": times, "chosen": chosen,
               "best": best, "chosen_over_best": times[chosen] / times[best]}
        rows.append(row)
        logger.info("split sweep %s %s H %d B %3d: %s | chosen %d (%.1f us) best %d (%.1f us) ratio %.3f", kernel,
                    fmt, heads, batch, " ".join(f"{k}:{v:.1f}" for k, v in times.items()), chosen, times[chosen], best,
                    times[best], row["chosen_over_best"])
    return rows


def flashmla_compare(pool: torch.Tensor, fmt: str, heads: int, top_k: int, batches: list[int]) -> list[dict]:
    """FlashMLA vs the Triton kernel (its chosen split) on the same inputs, each against the reference."""
    from kernels.sparse_mla_flashmla import flashmla_applies, sparse_mla_decode_flashmla

    rows = []
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for batch in batches:
        qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, top_k), device="cuda", dtype=torch.int32) for _ in range(2)]
        if not flashmla_applies(qs[0], pool, idx[0]):
            continue
        ref, ref_lse = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
        out, lse = sparse_mla_decode_flashmla(qs[0], pool, idx[0], SCALE)
        err = float((out.float() - ref.float()).norm() / ref.float().norm())
        lse_err = float((lse - ref_lse).abs().max())
        fm_us = bench(lambda i, q=qs, ix=idx: sparse_mla_decode_flashmla(q[i], pool, ix[i], SCALE), 2, flush)
        tr_us = bench(lambda i, q=qs, ix=idx: sparse_mla_decode_triton(q[i], pool, ix[i], SCALE), 2, flush)
        gl_us, gl_err = float("nan"), float("nan")
        if gluon_applies(qs[0], pool, idx[0]):
            gl_out, _ = sparse_mla_decode_gluon(qs[0], pool, idx[0], SCALE)
            gl_err = float((gl_out.float() - ref.float()).norm() / ref.float().norm())
            gl_us = bench(lambda i, q=qs, ix=idx: sparse_mla_decode_gluon(q[i], pool, ix[i], SCALE), 2, flush)
        flops = 2.0 * batch * heads * top_k * (576 + 512)
        row = {"fmt": fmt, "heads": heads, "batch": batch, "flashmla_us": fm_us, "triton_us": tr_us,
               "gluon_us": gl_us, "flashmla_tflops": flops / fm_us / 1e6, "triton_tflops": flops / tr_us / 1e6,
               "flashmla_rel_err": err, "flashmla_lse_max_abs_err": lse_err, "gluon_rel_err": gl_err,
               "flashmla_over_triton": fm_us / tr_us, "flashmla_over_gluon": fm_us / gl_us}
        rows.append(row)
        logger.info("flashmla %s H %d B %3d: flashmla %.1f us (%.0f TFLOP/s) triton %.1f us (%.0f) gluon %.1f us "
                    "err %.1e lse %.1e", fmt, heads, batch, fm_us, row["flashmla_tflops"], tr_us,
                    row["triton_tflops"], gl_us, err, lse_err)
    return rows


TP_BATCHES = [1, 4, 16, 32, 48, 64, 96, 128, 256]


def tp_heads_compare(pool: torch.Tensor, fmt: str, heads: int, top_k: int, batches: list[int]) -> list[dict]:
    """A tensor-parallel rank's heads (16 at TP 8, 32 at TP 4 of a 128-head model): the Triton kernel against the
    Gluon kernel padded to 64 heads (both at their chosen splits), and what `sparse_mla_decode` runs."""
    from kernels.dispatch import sparse_mla_decode

    rows = []
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for batch in batches:
        qs = [torch.randn(batch, heads, 576, device="cuda").bfloat16() for _ in range(2)]
        idx = [torch.randint(0, POOL_ROWS, (batch, top_k), device="cuda", dtype=torch.int32) for _ in range(2)]
        ref, _ = sparse_mla_decode_rows_ref(qs[0], pool, idx[0], SCALE)
        gl_out, _ = sparse_mla_decode_gluon(qs[0], pool, idx[0], SCALE)
        gl_err = float((gl_out.float() - ref.float()).norm() / ref.float().norm())
        tr_us = bench(lambda i, q=qs, ix=idx: sparse_mla_decode_triton(q[i], pool, ix[i], SCALE), 2, flush)
        gl_us = bench(lambda i, q=qs, ix=idx: sparse_mla_decode_gluon(q[i], pool, ix[i], SCALE), 2, flush)
        runs = "gluon" if gluon_applies(qs[0], pool, idx[0]) else "triton"
        assert torch.equal(sparse_mla_decode(qs[0], pool, idx[0], SCALE)[0],
                           gl_out if runs == "gluon" else sparse_mla_decode_triton(qs[0], pool, idx[0], SCALE)[0])
        row = {"fmt": fmt, "heads": heads, "batch": batch, "triton_us": tr_us, "gluon_padded_us": gl_us,
               "triton_over_gluon": tr_us / gl_us, "gluon_rel_err": gl_err, "dispatch_runs": runs}
        rows.append(row)
        logger.info("tp heads %s H %d B %3d: triton %.1f us gluon (padded) %.1f us (%.2fx) err %.1e, runs %s", fmt,
                    heads, batch, tr_us, gl_us, row["triton_over_gluon"], gl_err, runs)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--configs", action="store_true", help="also time alternative block sizes at B=64 H=128")
    parser.add_argument("--splits", action="store_true", help="sweep the split count at B 1..256 (H 128, 64)")
    parser.add_argument("--splits-gluon", action="store_true", help="the same sweep for the Gluon kernel (Hopper)")
    parser.add_argument("--flashmla", action="store_true", help="time FlashMLA next to the Triton kernel")
    parser.add_argument("--tp-heads", action="store_true",
                        help="a TP rank's 16 / 32 heads: the Triton kernel against the Gluon kernel padded to 64")
    parser.add_argument("--no-main", action="store_true", help="skip the main table (only --splits / --flashmla)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(0)
    top_k = 2048
    batches = [1, 16, 64, 128] if not args.quick else [1, 64]
    heads_list = [16, 64, 128]
    results: list[Result] = []
    sweeps: list[dict] = []
    compares: list[dict] = []
    tp_rows: list[dict] = []
    for fmt in ("bf16", "fp8"):
        pool = make_pool(fmt)
        for heads in (128, 64):
            if args.splits:
                sweeps += split_sweep(pool, fmt, heads, top_k, SWEEP_BATCHES)
            if args.splits_gluon:
                sweeps += split_sweep(pool, fmt, heads, top_k, SWEEP_BATCHES, kernel="gluon")
            if args.flashmla:
                compares += flashmla_compare(pool, fmt, heads, top_k, SWEEP_BATCHES)
        for heads in ((16, 32) if args.tp_heads else ()):
            tp_rows += tp_heads_compare(pool, fmt, heads, top_k, TP_BATCHES)
        for heads in ([] if args.no_main else heads_list):
            for batch in batches:
                r = run_case(pool, fmt, batch, heads, top_k, None, with_ref=True)
                results.append(r)
                logger.info("%s B %3d H %3d: %8.1f us %6.1f TFLOP/s %7.1f GB/s | ref %9.1f us (x%.1f) | err %.1e",
                            fmt, batch, heads, r.us, r.tflops, r.gbps, r.ref_us, r.speedup_vs_ref, r.rel_err)
        if args.configs and not args.no_main:
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
        args.json.write_text(json.dumps({"device": device_name(), "results": [asdict(r) for r in results],
                                         "split_sweep": sweeps, "flashmla": compares, "tp_heads": tp_rows},
                                        indent=1))
    if sweeps:
        print(f"\nsplit sweep, K={top_k}, {device_name()}: µs per split count; chosen vs best")
        print("| kernel | rows | H | B | " + " | ".join(f"s={s}" for s in sweeps[0]["times_us"])
              + " | chosen | best | ratio |")
        print("|---|---|---|---|" + "---|" * (len(sweeps[0]["times_us"]) + 3))
        for r in sweeps:
            print(f"| {r['kernel']} | {r['fmt']} | {r['heads']} | {r['batch']} | "
                  + " | ".join(f"{v:.1f}" for v in r["times_us"].values())
                  + f" | {r['chosen']} | {r['best']} | {r['chosen_over_best']:.3f} |")
        for kernel in sorted({r["kernel"] for r in sweeps}):
            worst = max(r["chosen_over_best"] for r in sweeps if r["kernel"] == kernel)
            print(f"{kernel}: worst chosen/best {worst:.3f} (target <= 1.05)")
    if compares:
        print(f"\nFlashMLA vs Triton and Gluon (chosen splits), K={top_k}, {device_name()}")
        print("| rows | H | B | FlashMLA µs | TFLOP/s | Triton µs | FlashMLA / Triton | Gluon µs | FlashMLA / Gluon "
              "| FlashMLA rel err | Gluon rel err |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in compares:
            print(f"| {r['fmt']} | {r['heads']} | {r['batch']} | {r['flashmla_us']:.1f} | {r['flashmla_tflops']:.0f} | "
                  f"{r['triton_us']:.1f} | {r['flashmla_over_triton']:.2f} | {r['gluon_us']:.1f} | "
                  f"{r['flashmla_over_gluon']:.2f} | {r['flashmla_rel_err']:.1e} | {r['gluon_rel_err']:.1e} |")
    if tp_rows:
        print(f"\nA TP rank's heads: Triton kernel vs Gluon padded to 64 heads, K={top_k}, {device_name()}")
        print("| rows | H | B | Triton µs | Gluon (padded) µs | Triton / Gluon | Gluon rel err | dispatch runs |")
        print("|---|---|---|---|---|---|---|---|")
        for r in tp_rows:
            print(f"| {r['fmt']} | {r['heads']} | {r['batch']} | {r['triton_us']:.1f} | {r['gluon_padded_us']:.1f} | "
                  f"{r['triton_over_gluon']:.2f} | {r['gluon_rel_err']:.1e} | {r['dispatch_runs']} |")
    if not results:
        return
    print(f"\nsparse MLA decode, K={top_k}, {device_name()}")
    print("| rows | B | H | config | us | TFLOP/s | GB/s | ref us | speed-up | rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r.fmt} | {r.batch} | {r.heads} | {r.config} | {r.us:.1f} | {r.tflops:.1f} | {r.gbps:.0f} | "
              f"{r.ref_us:.0f} | {r.speedup_vs_ref:.0f} | {r.rel_err:.1e} |")


if __name__ == "__main__":
    main()
