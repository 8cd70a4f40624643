"""Long-prompt prefill, dense vs colocated HiSparse (issue 13 item 6: HiSparse prefill within 10 % of dense at 32K).

For each prompt length and each mode, one engine of the same model is built from the same budgets, and one prompt
is prefilled through the real engine loop (schedule → forward → sample, chunked by `--chunked-prefill-size`,
the server's default 2048) until its first token: the time to first token of a request alone in the engine.
Modes:
  dense             all KV on the device (the baseline)
  hisparse          host pool + device buffers; each chunk attends over the device prefill staging area
                    (decode_server/hisparse/prefill_staging.py)
  hisparse-gather   the same without a staging area (`prefill_staging_tokens` 0): each chunk gathers its
                    selected rows from the host pool on the CPU (the reference path, what prefill did before)
Reports the median prefill time, tokens/s, the ratio to dense and the PCIe bytes per prefill; prints a table
last and writes JSON to benchmarks/results/.

`--cached-prefix-fractions F ...`: each mode again with prefix caching on (`--enable-prefix-caching`), where every
timed prompt shares its first F × length tokens with a prompt prefilled before it (a system prompt, a chat's
history) and ends in fresh tokens: the time to first token when that prefix is found in the cache (the rows
report `cached_prefix` F and the tokens reused).

GPU:   python benchmarks/bench_prefill.py                      (dsv32-bench, 8K and 32K prompts)
       python benchmarks/bench_prefill.py --quantization fp8   (FP8 weights; HISPARSE_FP8_GEMM=triton: no cuBLAS)
CPU:   python benchmarks/bench_prefill.py --smoke              (tiny-dsa, short prompts; checks the script)
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine, resolve_attention_kernel
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import build_random_model, load_config
from kernels import fp8_gemm

logger = logging.getLogger("bench_prefill")
GIB = 1 << 30
MODES = ("dense", "hisparse", "hisparse-gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="dsv32-bench", help="model config name in configs/ or a checkpoint dir")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--chunked-prefill-size", type=int, default=EngineConfig().chunked_prefill_size)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--repeats", type=int, default=3, help="timed prefills per mode and length (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed prefills of the same prompt first")
    p.add_argument("--device-kv-budget-gib", type=float, default=4.0)
    p.add_argument("--host-kv-budget-gib", type=float, default=1.0)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16", "fp8_e4m3"])
    p.add_argument("--quantization", default="none", choices=["none", "fp8"],
                   help="random weights in the model dtype, or block-FP8 projections (a checkpoint's FP8 layout); "
                        "FP8 GEMM choices follow the GPU's table ($HISPARSE_FP8_GEMM=triton|scaled_mm restricts them)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "flashmla", "triton"])
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/bench_prefill[_smoke].json)")
    p.add_argument("--cached-prefix-fractions", type=float, nargs="*", default=[],
                   help="also time prompts whose first F x length tokens are in the prefix cache, per fraction F")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: tiny-dsa, 2 short prompts")
    args = p.parse_args(argv)
    if args.smoke:
        args.config = "tiny-dsa"
        args.prompt_lens = [96, 200]
        args.chunked_prefill_size = 64
        args.repeats, args.warmup = 1, 1
        args.device_kv_budget_gib = 64 / 1024
        args.host_kv_budget_gib = 64 / 1024
        args.page_size = 16
        args.device = "cpu" if args.device == "auto" else args.device
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out or f"benchmarks/results/{'bench_prefill_smoke' if args.smoke else 'bench_prefill'}.json"
    return args


def build_engine(args, model, model_config, mode: str, prefix_caching: bool = False) -> Engine:
    cfg = EngineConfig(
        enable_prefix_caching=prefix_caching,
        device=args.device, enable_hisparse=mode != "dense", page_size=args.page_size,
        context_length=max(args.prompt_lens) + args.page_size, kv_cache_dtype=args.kv_cache_dtype,
        attention_backend=args.attention_backend, device_kv_budget_bytes=int(args.device_kv_budget_gib * GIB),
        host_kv_budget_bytes=int(args.host_kv_budget_gib * GIB), max_running_requests=2,
        chunked_prefill_size=args.chunked_prefill_size,
        hisparse=HiSparseConfig(prefill_staging_tokens=0 if mode == "hisparse-gather" else None),
    )
    return Engine(cfg, model=model, model_config=model_config, tokenizer=None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory(device: torch.device) -> None:
    """After an engine was dropped: collect it and give its pools back, so that the next mode's budgets fit."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill_once(engine: Engine, rid: str, prompt: list[int]) -> float:
    """Seconds from adding the request to its first token (it asks for one token, so it also finishes)."""
    sync(engine.device)
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    done = False
    while not done:
        done = any(d.rid == rid and d.finished for d in engine.step())
    sync(engine.device)
    return time.perf_counter() - t0


def pcie_bytes(engine: Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats.bytes_h2d, stats.bytes_d2h


def run_mode(args, model, model_config, mode: str, prompts: dict[int, list[int]]) -> list[dict]:
    engine = build_engine(args, model, model_config, mode)
    results = []
    try:
        for length, prompt in prompts.items():
            for i in range(args.warmup):
                prefill_once(engine, f"warm{length}-{i}", prompt)
            up0, down0 = pcie_bytes(engine)
            times = [prefill_once(engine, f"p{length}-{i}", prompt) for i in range(args.repeats)]
            up1, down1 = pcie_bytes(engine)
            if not engine.is_idle_and_empty():
                raise RuntimeError(f"{mode}: pools not empty after the prefills")
            backend = getattr(engine.kv, "backend", None)
            ms = 1000 * statistics.median(times)
            results.append({
                "mode": mode, "prompt_len": length, "chunk": args.chunked_prefill_size, "repeats": args.repeats,
                "ms": ms, "ms_all": [1000 * t for t in times], "tokens_per_s": length / (ms / 1000),
                "h2d_bytes": (up1 - up0) // args.repeats, "d2h_bytes": (down1 - down0) // args.repeats,
                "staged_forwards": getattr(backend, "staged_prefill_forwards", None),
                "gathered_forwards": getattr(backend, "gathered_prefill_forwards", None),
                "staging_rows": getattr(getattr(engine.kv, "layout", None), "prefill_staging_rows", None),
            })
    finally:
        device = engine.device
        del engine
        free_device_memory(device)
    return results


def run_cached(args, model, model_config, mode: str, fraction: float, prompts: dict[int, list[int]],
               gen: torch.Generator) -> list[dict]:
    """Prefill times of prompts whose first `fraction` of tokens are cached: a prompt with the shared prefix and
    its own tail is prefilled first (untimed), then each timed prompt is the prefix + fresh tokens."""
    engine = build_engine(args, model, model_config, mode, prefix_caching=True)
    vocab = int(model_config.vocab_size)
    results = []
    try:
        for length, prompt in prompts.items():
            shared = prompt[: int(fraction * length)]

            def fresh(shared: list[int] = shared, length: int = length) -> list[int]:
                return shared + torch.randint(2, vocab, (length - len(shared),), generator=gen).tolist()

            for i in range(max(1, args.warmup)):
                prefill_once(engine, f"warm{length}-{i}", fresh())
            hits0 = engine.stats().prefix_cache.hit_tokens
            times = [prefill_once(engine, f"p{length}-{i}", fresh()) for i in range(args.repeats)]
            cached = (engine.stats().prefix_cache.hit_tokens - hits0) // args.repeats
            engine.flush_prefix_cache()
            if not engine.is_idle_and_empty() or any(pool.used for pool in engine.kv.usage().values()):
                raise RuntimeError(f"{mode}: pools not empty after the prefills and a cache flush")
            ms = 1000 * statistics.median(times)
            results.append({
                "mode": mode, "cached_prefix": fraction, "cached_tokens": cached, "prompt_len": length,
                "chunk": args.chunked_prefill_size, "repeats": args.repeats, "ms": ms,
                "ms_all": [1000 * t for t in times], "tokens_per_s": length / (ms / 1000),
            })
    finally:
        device = engine.device
        del engine
        free_device_memory(device)
    return results


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_config = load_config(args.config)
    model = build_random_model(model_config, device, dtype, seed=args.seed, quantization=args.quantization)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = int(model_config.vocab_size)
    prompts = {n: torch.randint(2, vocab, (n,), generator=gen).tolist() for n in args.prompt_lens}
    results: list[dict] = []
    for mode in args.modes:
        for fraction in [None, *args.cached_prefix_fractions]:
            try:
                results += (run_mode(args, model, model_config, mode, prompts) if fraction is None
                            else run_cached(args, model, model_config, mode, fraction, prompts, gen))
            except (ValueError, RuntimeError, torch.OutOfMemoryError) as exc:
                logger.warning("skipped %s (cached prefix %s): %s", mode, fraction, exc)
                results.append({"mode": mode, "cached_prefix": fraction, "error": str(exc)})
    dense = {r["prompt_len"]: r["ms"] for r in results
             if r["mode"] == "dense" and "error" not in r and "cached_prefix" not in r}
    for r in results:
        if "error" not in r and r["prompt_len"] in dense:
            r["time_vs_dense"] = r["ms"] / dense[r["prompt_len"]]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    kernel = resolve_attention_kernel(args.attention_backend, device, False) if device.type == "cuda" else "reference"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fp8_backend = (os.environ.get(fp8_gemm.BACKEND_ENV) or "auto") if args.quantization == "fp8" else None
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device_name,
            "attention_kernel": kernel, "fp8_gemm_backend": fp8_backend, "command": " ".join(sys.argv),
            "args": vars(args)}
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {out}")
    weights = "fp8 (FP8 GEMMs: " + fp8_backend + ")" if fp8_backend else "model dtype"
    print(f"device: {device_name}; config: {args.config}; weights {weights}; KV {args.kv_cache_dtype}; attention "
          f"{kernel}; chunk {args.chunked_prefill_size}; median of {args.repeats}")
    print(f"{'mode':<17}{'cached':>8}{'prompt':>8}{'ms':>11}{'tok/s':>12}{'vs dense':>10}{'H2D MB':>10}"
          f"{'D2H MB':>10}")
    for r in results:
        if "error" in r:
            print(f"{r['mode']:<17}  error: {r['error']}")
            continue
        ratio = f"{r['time_vs_dense']:.3f}" if "time_vs_dense" in r else "-"
        cached = str(r["cached_tokens"]) if "cached_tokens" in r else "-"
        pcie = (f"{r['h2d_bytes'] / 1e6:>10.1f}{r['d2h_bytes'] / 1e6:>10.1f}" if "h2d_bytes" in r
                else f"{'-':>10}{'-':>10}")
        print(f"{r['mode']:<17}{cached:>8}{r['prompt_len']:>8}{r['ms']:>11.1f}{r['tokens_per_s']:>12.0f}"
              f"{ratio:>10}{pcie}")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
