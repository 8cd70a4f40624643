"""Block-FP8 GEMMs against bf16 at DeepSeek-V3.2's projection shapes (issue 21).

For each projection kind (q_a 7168→1536, q_b 1536→24576 and its TP shards, kv_a 7168→576, o_proj 16384→7168,
indexer wq_b 1536→8192 and wk 7168→128, dense MLP 7168→18432 / 18432→7168, shared expert 7168→2048 / 2048→7168,
routed experts as a grouped GEMM: 32 local experts, top-8 per token, 7168↔2048, and gate + up joined, 7168→4096)
and each M (tokens):
  bf16        F.linear (grouped: torch._grouped_mm) on bf16 weights;
  scaled_mm   torch._scaled_mm, 1×128 activation × 128×128 weight block scales (SM90, where the shape allows);
  triton      the Triton block-FP8 kernel with the configuration the autotuner finds best among its own;
  auto        what the autotuner picks among all (the engine's choice), its time.
Each FP8 time includes the activation quantization (part of every FP8 linear). Times are µs per call from CUDA
events around a CUDA graph of many calls replayed (no launch cost), each call on another copy of the weights so
that the L2 cache holds none of them (weights read from HBM, as in a decode step). GB/s = weight bytes read (FP8:
values + block scales; grouped: the experts the batch routed to) / time, and the fraction of the HBM bandwidth
measured in the same run by a plain device copy (read + write counted). The summary line adds one MoE layer's
projections at each M (q_a, q_b, kv_a, o_proj, wq_b, wk, shared gate + up + down, routed gate + up + down), with
the routed gate and up apart and joined (decode_server/model/moe.py `gate_up_stack`): FP8 (auto) / bf16, the
decode step's GEMM ratio that issue 21 targets at ≤ 0.6 for M = 1.

GPU:  python benchmarks/bench_fp8_gemm.py [--m 1 16 64 128 256] [--out benchmarks/results/bench_fp8_gemm.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import device_name, hbm_copy_gbps, time_graph_us  # noqa: E402

from kernels import fp8_gemm  # noqa: E402

logger = logging.getLogger("bench_fp8_gemm")
BLOCK = (128, 128)
EXPERTS, TOP_K = 32, 8
# (name, N, K, kind); "grouped" shapes are per expert.
SHAPES = [
    ("q_a 7168→1536", 1536, 7168, "dense"),
    ("q_b 1536→24576", 24576, 1536, "dense"),
    ("q_b TP2 1536→12288", 12288, 1536, "dense"),
    ("q_b TP4 1536→6144", 6144, 1536, "dense"),
    ("q_b TP8 1536→3072", 3072, 1536, "dense"),
    ("kv_a 7168→576", 576, 7168, "dense"),
    ("o_proj 16384→7168", 7168, 16384, "dense"),
    ("indexer wq_b 1536→8192", 8192, 1536, "dense"),
    ("indexer wk 7168→128", 128, 7168, "dense"),
    ("dense MLP 7168→18432", 18432, 7168, "dense"),
    ("dense MLP 18432→7168", 7168, 18432, "dense"),
    ("shared expert 7168→2048", 2048, 7168, "dense"),
    ("shared expert 2048→7168", 7168, 2048, "dense"),
    ("routed E32 top8 7168→2048", 2048, 7168, "grouped"),
    ("routed E32 top8 2048→7168", 7168, 2048, "grouped"),
    ("routed E32 top8 gate+up 7168→4096", 4096, 7168, "grouped"),
    # The engine's fused forms (decode_server/model/fused_linear.py, moe.py): q_a + the indexer's wk + kv_a as one
    # GEMM of x, q_b + the indexer's wq_b as one GEMM of the query latent, the shared expert as each token's ninth
    # choice in the routed experts' grouped GEMMs (33 experts: 32 routed + the shared one last).
    ("inputs q_a+wk+kv_a 7168→2240", 2240, 7168, "dense"),
    ("queries q_b+wq_b 1536→32768", 32768, 1536, "dense"),
    ("routed+shared E33 top8+1 gate+up 7168→4096", 4096, 7168, "grouped+shared"),
    ("routed+shared E33 top8+1 2048→7168", 7168, 2048, "grouped+shared"),
]
# One MoE layer's projections of a decode step (how many times each runs): gate and up share a shape.
LAYER = {"q_a 7168→1536": 1, "q_b 1536→24576": 1, "kv_a 7168→576": 1, "o_proj 16384→7168": 1,
         "indexer wq_b 1536→8192": 1, "indexer wk 7168→128": 1, "shared expert 7168→2048": 2,
         "shared expert 2048→7168": 1, "routed E32 top8 7168→2048": 2, "routed E32 top8 2048→7168": 1}
# The same layer with the routed experts' gate and up as one grouped GEMM ([E, 2I, H]: MoE.gate_up_stack).
LAYER_JOINED = {**{name: count for name, count in LAYER.items() if name != "routed E32 top8 7168→2048"},
                "routed E32 top8 gate+up 7168→4096": 1}
# The same layer as the engine's decode step runs it (every fusion on, as on DeepSeek-V3.2's FP8 checkpoints): five
# GEMMs. The step read rate of issue 21 is this form's.
LAYER_ENGINE = {"inputs q_a+wk+kv_a 7168→2240": 1, "queries q_b+wq_b 1536→32768": 1, "o_proj 16384→7168": 1,
                "routed+shared E33 top8+1 gate+up 7168→4096": 1, "routed+shared E33 top8+1 2048→7168": 1}
FORMS = (("apart", LAYER), ("joined", LAYER_JOINED), ("engine", LAYER_ENGINE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 128, 256], help="tokens (rows of x)")
    p.add_argument("--shapes", nargs="*", default=None, help="substrings of shape names to run (default: all)")
    p.add_argument("--calls", type=int, default=16, help="calls per captured graph (weight copies rotate)")
    p.add_argument("--out", default="benchmarks/results/bench_fp8_gemm.json")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def copies_for(nbytes: int, l2: int, cap: int = 64) -> int:
    """Weight copies so that one graph's calls read more than twice the L2 cache (every read from HBM)."""
    return max(1, min(cap, math.ceil(2 * l2 / max(1, nbytes))))


def random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(shape, device="cuda", generator=gen).mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    scale_shape = (*shape[:-2], math.ceil(shape[-2] / 128), math.ceil(shape[-1] / 128))
    return w, torch.rand(scale_shape, device="cuda", generator=gen).add_(0.5).mul_(1e-3)


def routing(m: int, gen: torch.Generator, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """m tokens × TOP_K distinct experts of EXPERTS, uniformly at random, plus (`shared`) each token's row on the
    shared expert, expert EXPERTS → (row order, end offsets, experts hit). Row r belongs to token r // choices."""
    scores = torch.rand(m, EXPERTS, device="cuda", generator=gen)
    ids = scores.topk(TOP_K, dim=-1).indices
    if shared:
        ids = torch.cat([ids, torch.full((m, 1), EXPERTS, device="cuda", dtype=ids.dtype)], dim=1)
    ids = ids.flatten()
    experts = EXPERTS + int(shared)
    sorted_ids, order = torch.sort(ids, stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(experts, device="cuda"), right=True).to(torch.int32)
    return order, ends, int(torch.unique(ids).numel())


def choose(restriction: str, kind: str, weights, m: int) -> fp8_gemm.GemmChoice:
    """The autotuner's pick under a backend restriction (a fresh tuner: nothing cached from other runs); grouped
    shapes timed on this bench's routing (top-8 distinct experts a token), as the engine's warm-up times them."""
    fp8_gemm.reset_tuner("measure")
    routing = fp8_gemm.Routing(TOP_K, kind == "grouped+shared") if kind.startswith("grouped") else None
    with fp8_gemm.force_backend(restriction):
        return fp8_gemm.tune(kind.split("+")[0], weights, m, torch.bfloat16, BLOCK, routing)


def bench_shape(name: str, n: int, k: int, kind: str, m: int, args, l2: int, gen) -> dict:
    row: dict = {"shape": name, "kind": kind, "n": n, "k": k, "m": m}
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    if kind.startswith("grouped"):
        shared = kind == "grouped+shared"
        order, ends, hit = routing(m, gen, shared)
        xs = x[order // (TOP_K + int(shared))].contiguous()
        experts = EXPERTS + int(shared)
        w16 = (torch.randn(experts, n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
        w8 = [random_fp8((experts, n, k), gen)]
        row.update(rows=xs.shape[0], experts_hit=hit)
        bf16_bytes = hit * n * k * 2
        fp8_bytes = hit * (n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128))
        row["bf16_us"] = time_graph_us(lambda i: torch._grouped_mm(xs, w16.transpose(1, 2), offs=ends), args.calls)
        del w16

        def run(choice, i):
            w, s = w8[i % len(w8)]
            return fp8_gemm._run_grouped(choice, xs, w, s, ends, BLOCK, torch.bfloat16)
        rows = xs.shape[0]
    else:
        bf16_bytes = n * k * 2
        fp8_bytes = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128)
        w16 = [(torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).to(torch.bfloat16)
               for _ in range(copies_for(bf16_bytes, l2))]
        row["bf16_us"] = time_graph_us(lambda i: F.linear(x, w16[i % len(w16)]), args.calls)
        del w16
        w8 = [random_fp8((n, k), gen) for _ in range(copies_for(fp8_bytes, l2))]

        def run(choice, i):
            w, s = w8[i % len(w8)]
            return fp8_gemm._run_dense(choice, x, w, s, BLOCK, torch.bfloat16)
        rows = m
    torch.cuda.synchronize()
    row["bf16_gbps"] = bf16_bytes / (row["bf16_us"] * 1e-6) / 1e9
    if kind == "dense" and fp8_gemm.scaled_mm_supported(n, k, BLOCK, x.device):
        try:
            row["scaled_mm_us"] = time_graph_us(lambda i: run(fp8_gemm.GemmChoice("scaled_mm"), i), args.calls)
        except Exception as exc:  # noqa: BLE001 - reported, the other backends still run
            row["scaled_mm_error"] = f"{type(exc).__name__}: {exc}"
    triton_choice = choose("triton", kind, w8, rows)
    row["triton_config"] = triton_choice.label()
    row["triton_us"] = time_graph_us(lambda i: run(triton_choice, i), args.calls)
    auto = choose("auto", kind, w8, rows)
    row["auto_pick"] = auto.label()
    if auto.backend == "scaled_mm" and "scaled_mm_us" in row:
        row["auto_us"] = row["scaled_mm_us"]
    elif auto == triton_choice:
        row["auto_us"] = row["triton_us"]
    else:
        row["auto_us"] = time_graph_us(lambda i: run(auto, i), args.calls)
    record = fp8_gemm.tuner().records[-1] if fp8_gemm.tuner().records else None
    row["tuner_timings_us"] = dict(record.timings_us) if record else {}
    row["tuner_rejected"] = list(record.rejected) if record else []
    row["fp8_bytes"], row["bf16_bytes"] = fp8_bytes, bf16_bytes
    row["fp8_gbps"] = fp8_bytes / (row["auto_us"] * 1e-6) / 1e9
    row["ratio_vs_bf16"] = row["auto_us"] / row["bf16_us"]
    return row


def summary(rows: list[dict], hbm: float) -> list[dict]:
    """Per M and layer form (gate and up of the routed experts apart, `LAYER`; joined, `LAYER_JOINED`; every fusion
    of the engine, `LAYER_ENGINE`): one MoE layer's projections, FP8 (auto) against bf16."""
    out = []
    for form, layer in FORMS:
        for m in sorted({r["m"] for r in rows}):
            at = {r["shape"]: r for r in rows if r["m"] == m and "error" not in r}
            if not all(name in at for name in layer):
                continue
            fp8 = sum(at[s]["auto_us"] * c for s, c in layer.items())
            bf16 = sum(at[s]["bf16_us"] * c for s, c in layer.items())
            fp8_bytes = sum(at[s]["fp8_bytes"] * c for s, c in layer.items())
            out.append({"m": m, "form": form, "layer_fp8_us": fp8, "layer_bf16_us": bf16,
                        "ratio": fp8 / bf16, "layer_fp8_gbps": fp8_bytes / (fp8 * 1e-6) / 1e9,
                        "layer_fp8_hbm_fraction": fp8_bytes / (fp8 * 1e-6) / 1e9 / hbm})
    return out


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_gemm needs a CUDA GPU")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    props = torch.cuda.get_device_properties(0)
    l2 = int(getattr(props, "L2_cache_size", 0) or 50 << 20)
    hbm = hbm_copy_gbps()
    shapes = [s for s in SHAPES if not args.shapes or any(sub in s[0] for sub in args.shapes)]
    rows: list[dict] = []
    start = time.perf_counter()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "hbm_copy_gbps": hbm, "l2_bytes": l2,
            "command": " ".join(sys.argv), "calls_per_graph": args.calls}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    for name, n, k, kind in shapes:
        for m in args.m:
            try:
                rows.append(bench_shape(name, n, k, kind, m, args, l2, gen))
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - one failing case is reported, the rest still run
                logger.exception("%s M=%d failed", name, m)
                rows.append({"shape": name, "kind": kind, "n": n, "k": k, "m": m,
                             "error": f"{type(exc).__name__}: {exc}"})
                torch.cuda.empty_cache()
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    layer = summary(rows, hbm)
    meta["seconds"] = time.perf_counter() - start
    out.write_text(json.dumps({"meta": meta, "rows": rows, "layer_summary": layer}, indent=2))
    print(f"device: {meta['device']}; torch {meta['torch']} (CUDA {meta['cuda']}), triton {meta['triton']}; "
          f"HBM copy {hbm:.0f} GB/s; µs per call (CUDA-graph replay, weights from HBM)")
    print(f"{'shape':<44}{'M':>5}{'bf16':>9}{'scaled_mm':>11}{'triton':>9}{'auto':>9}{'fp8/bf16':>9}"
          f"{'GB/s':>7}{'%HBM':>6}  auto pick")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:<44}{r['m']:>5}  error: {r['error'][:80]}")
            continue
        smm = f"{r['scaled_mm_us']:>11.1f}" if "scaled_mm_us" in r else f"{'-':>11}"
        print(f"{r['shape']:<44}{r['m']:>5}{r['bf16_us']:>9.1f}{smm}{r['triton_us']:>9.1f}{r['auto_us']:>9.1f}"
              f"{r['ratio_vs_bf16']:>9.2f}{r['fp8_gbps']:>7.0f}{100 * r['fp8_gbps'] / hbm:>6.0f}  {r['auto_pick']}")
    for s in layer:
        print(f"one MoE layer's projections ({s['form']}) at M={s['m']}: FP8 {s['layer_fp8_us']:.1f} µs vs bf16 "
              f"{s['layer_bf16_us']:.1f} µs = {s['ratio']:.2f}x; FP8 weights at {s['layer_fp8_gbps']:.0f} GB/s = "
              f"{100 * s['layer_fp8_hbm_fraction']:.0f} % of HBM")
    print(f"wrote {out} ({meta['seconds']:.0f} s)")
    return 0 if rows and not all("error" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
