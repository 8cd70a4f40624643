"""Whole decode steps with block-FP8 weights against the same model's weights dequantized to bf16 (issue 21).

One random FP8 model is built on the GPU (`build_random_model(..., quantization="fp8")`, seconds) and its bf16
twin is the same weights dequantized (`construct.dequantized_copy`). For each batch size, each model runs the
real engine loop in dense mode (bench_decode.py's engine, synthetic KV of `--context` tokens injected, CUDA graphs
captured for the batch's bucket, overlap scheduling as the server runs it): step ms = wall time of `--steps`
engine steps / steps; then `--profile-steps` more steps under torch.profiler, whose CUDA kernels are summed by
kind — "GEMM" = matmul-like kernels (cuBLAS / CUTLASS / nvjet GEMMs, torch grouped GEMMs, the Triton FP8 GEMMs,
their split-K sums and activation quantization) — for the GEMMs' time per step. The LM head (bf16 in both models,
as in the checkpoints) is timed alone at each batch (CUDA-graph replay) and reported, so the projections' ratio can
be read without it. Targets (issue 21, batch 1): GEMMs ≤ 0.6× bf16, whole step ≤ 0.7×.

GPU:  python benchmarks/bench_fp8_step.py [--config dsv32-bench-16l] [--batches 1 16 64] [--context 4096]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import logging
import re
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _timing import device_name, hbm_copy_gbps, time_graph_us  # noqa: E402

from decode_server.model import build_random_model, fused_ops, load_config  # noqa: E402
from decode_server.model.construct import dequantized_copy  # noqa: E402
from decode_server.model.moe import MoE, set_shared_experts_fusion  # noqa: E402
from decode_server.model.weights import weight_bytes  # noqa: E402
from kernels import fp8_gemm  # noqa: E402

logger = logging.getLogger("bench_fp8_step")
GEMM_RE = re.compile(r"gemm|nvjet|xmma|cutlass|matmul|_fp8_|splitk|wgmma|gemv|grouped_mm|_quantize_kernel", re.I)
# cuBLAS names its block-scaled FP8 GEMMs (torch._scaled_mm) nvjet_sm90_qqtst_*.
FP8_RE = re.compile(r"_fp8_|_splitk_sum|_quantize_kernel|e4m3|f8f8|qqtst", re.I)


def _bench_decode():
    spec = importlib.util.spec_from_file_location("bench_decode", HERE / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv32-bench-16l", help="model config (configs/ name)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=4096, help="tokens of synthetic KV per request")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--eager-ops", action="store_true",
                   help="run RMSNorm, residual add + norm and rotary embeddings as eager PyTorch ops instead of "
                        "their one-kernel Triton versions (decode_server/model/fused_ops.py), for a same-call A/B")
    p.add_argument("--eager-router", action="store_true",
                   help="only the MoE router's selection as eager PyTorch ops (kernels/moe_route_triton.py off), "
                        "the other fused ops as configured")
    p.add_argument("--disable-shared-experts-fusion", action="store_true",
                   help="the FP8 model's shared experts as their own GEMMs (the server's flag of that name)")
    p.add_argument("--top-kernels", type=int, default=25,
                   help="kernels (by device time) listed per run, each with its µs and launches per step")
    p.add_argument("--device-kv-budget-gib", type=float, default=8.0)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/bench_fp8_step.json")
    return p.parse_args(argv)


def kernel_times(prof) -> list[tuple[str, float, int]]:
    """(kernel name, total device µs, launches) of every CUDA kernel the profiler saw, slowest first."""
    out = []
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = getattr(evt, "cuda_time_total", 0.0)
        if total and getattr(evt, "device_type", None) is not None and str(evt.device_type).endswith("CUDA"):
            out.append((evt.key, float(total), int(evt.count)))
    return sorted(out, key=lambda kv: -kv[1])


def run_model(bd, label: str, model, config, batch: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    bd_args = bd.parse_args(["--config", args.config, "--contexts", str(args.context), "--steps", str(args.steps),
                             "--warmup", "3", "--device-kv-budget-gib", str(args.device_kv_budget_gib),
                             "--kv-cache-dtype", args.kv_cache_dtype, "--seed", str(args.seed)])
    bd_args.device = "cuda"
    device = torch.device("cuda")
    max_len = args.context + 3 + args.steps + args.profile_steps + 8
    engine, _sizing = bd.build_engine(bd_args, model, config, "dense", args.context, max_len, batch,
                                      int(args.device_kv_budget_gib * bd.GIB))
    synthetic = bd.SyntheticKV(args.context, engine.kv_dtype, device, args.seed)
    n = bd.fill(engine, synthetic, args.context, max_len, batch, args.seed)
    if n < batch:
        raise RuntimeError(f"only {n} of {batch} requests fit the KV budget")
    graphs = bd.capture_graphs(bd_args, engine, n)
    for _ in range(3):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    torch.cuda.synchronize()
    step_ms = 1000 * (time.perf_counter() - start) / args.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = kernel_times(prof)
    per_step = args.profile_steps
    gemm_us = sum(t for name, t, _ in kernels if GEMM_RE.search(name)) / per_step
    fp8_us = sum(t for name, t, _ in kernels if GEMM_RE.search(name) and FP8_RE.search(name)) / per_step
    all_us = sum(t for _, t, _ in kernels) / per_step
    launches = sum(c for _, _, c in kernels) / per_step
    gemm_launches = sum(c for name, _, c in kernels if GEMM_RE.search(name)) / per_step
    result = {"weights": label, "batch": n, "step_ms": step_ms, "gemm_ms": gemm_us / 1000,
              "fp8_gemm_ms": fp8_us / 1000, "kernels_ms": all_us / 1000, "kernels_per_step": launches,
              "gemm_kernels_per_step": gemm_launches, "quantization": engine.quantization,
              "weights_bytes": engine.weight_bytes, "graph_replays": getattr(engine.graph_runner, "num_replays", 0),
              "top_kernels": [(name[:120], t / per_step, c / per_step) for name, t, c in kernels[:args.top_kernels]],
              **graphs}
    del engine, synthetic
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kernels.fp8_gemm").setLevel(logging.INFO)
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fp8_step needs a CUDA GPU")
        return 1
    fused_ops.set_enabled(not args.eager_ops)
    fused_ops.set_router_enabled(not args.eager_router)
    set_shared_experts_fusion(not args.disable_shared_experts_fusion)
    bd = _bench_decode()
    config = load_config(args.config)
    t0 = time.perf_counter()
    model8 = build_random_model(config, "cuda", torch.bfloat16, seed=args.seed, quantization="fp8")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    model16 = dequantized_copy(model8)
    hbm = hbm_copy_gbps()
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name(),
            "config": args.config, "context": args.context, "fp8_build_s": build_s, "hbm_copy_gbps": hbm,
            "weights_bytes": {"fp8": weight_bytes(model8), "bf16": weight_bytes(model16)},
            "command": " ".join(sys.argv), "torch": torch.__version__, "fused_ops": fused_ops.enabled(),
            "fused_router": fused_ops.router_enabled(),
            "shared_experts_fused": sum(m.fuses_shared for m in model8.modules() if isinstance(m, MoE))}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    head = model16.lm_head.weight
    for batch in args.batches:
        pair = {}
        for label, model in (("fp8", model8), ("bf16", model16)):
            try:
                pair[label] = run_model(bd, label, model, config, batch, args)
            except Exception as exc:  # noqa: BLE001 - reported, the other runs continue
                logger.exception("%s weights at batch %d failed", label, batch)
                pair[label] = {"weights": label, "batch": batch, "error": f"{type(exc).__name__}: {exc}"}
                gc.collect()
                torch.cuda.empty_cache()
        hidden = torch.randn(batch, config.hidden_size, device="cuda", dtype=torch.bfloat16)
        lm_head_ms = time_graph_us(lambda i, h=hidden: F.linear(h, head), 4) / 1000
        row = {"batch": batch, "lm_head_ms": lm_head_ms, **{f"{k}_run": v for k, v in pair.items()}}
        if all("error" not in v for v in pair.values()):
            f8, b16 = pair["fp8"], pair["bf16"]
            row.update(step_ratio=f8["step_ms"] / b16["step_ms"], gemm_ratio=f8["gemm_ms"] / b16["gemm_ms"],
                       gemm_ratio_without_lm_head=(f8["gemm_ms"] - lm_head_ms) / max(1e-9, b16["gemm_ms"] - lm_head_ms))
        rows.append(row)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    meta["tuning"] = [{"kind": r.kind, "n": r.n, "k": r.k, "experts": r.experts, "bucket": r.bucket,
                       "choice": r.choice.label(), "timings_us": r.timings_us, "rejected": r.rejected}
                      for r in fp8_gemm.tuner().records]
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    wb8, wb16 = meta["weights_bytes"]["fp8"]["total"], meta["weights_bytes"]["bf16"]["total"]
    print(f"device: {meta['device']}; config {args.config}; context {args.context}; dense, CUDA graphs; weights "
          f"FP8 {wb8 / 2**30:.2f} GiB vs bf16 {wb16 / 2**30:.2f} GiB; FP8 model built in {build_s:.1f} s")
    print(f"{'batch':>5}{'step fp8':>10}{'step bf16':>10}{'ratio':>7}{'GEMM fp8':>10}{'GEMM bf16':>10}{'ratio':>7}"
          f"{'lm_head':>9}{'ratio w/o head':>16}{'kernels fp8':>13}{'other ms':>10}")
    for r in rows:
        f8, b16 = r.get("fp8_run", {}), r.get("bf16_run", {})
        if "step_ratio" not in r:
            print(f"{r['batch']:>5}  error: {f8.get('error') or b16.get('error')}")
            continue
        print(f"{r['batch']:>5}{f8['step_ms']:>10.3f}{b16['step_ms']:>10.3f}{r['step_ratio']:>7.2f}"
              f"{f8['gemm_ms']:>10.3f}{b16['gemm_ms']:>10.3f}{r['gemm_ratio']:>7.2f}{r['lm_head_ms']:>9.3f}"
              f"{r['gemm_ratio_without_lm_head']:>16.2f}{f8['kernels_per_step']:>13.0f}"
              f"{f8['kernels_ms'] - f8['gemm_ms']:>10.3f}")
    print(f"(ms per step; GEMM = matmul-like kernels from the profiler; kernels fp8 = launches per FP8 step; other "
          f"ms = the FP8 step's non-GEMM kernel time; targets at batch 1: GEMM ratio ≤ 0.6, step ratio ≤ 0.7) "
          f"wrote {out}")
    return 0 if any("step_ratio" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
