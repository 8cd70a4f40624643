"""What each rank runs in tests/parallel/test_tp_graphs_gpu.py: "wide" tiny-dsa (64 heads, top-k 128: the GPU
kernels) through the real Engine on `cuda:<rank>` in bf16, NCCL between the ranks, TP=2 and EP=2, with CUDA graphs
and overlap scheduling on (the CUDA defaults), against the same padded decode batches run eagerly (the graph
runner's uncaptured path), dense and HiSparse."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS / "hisparse") not in sys.path:
    sys.path.append(str(_TESTS / "hisparse"))

from harness import Arrival, make_engine, random_prompt, run_script  # noqa: E402
from tp_gpu_workers import WIDE_TOP_K, wide_config  # noqa: E402

from decode_server.model import Tokenizer, build_random_model, resolve_model_path  # noqa: E402
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel  # noqa: E402

WORLD = 2
BUCKETS = [1, 2, 4, 8]


def graph_arrivals() -> list[Arrival]:
    """Eight requests arriving over 12 steps, prompts shorter and longer than the device buffer (128 rows): decode
    batches of 1 to 8 (every bucket, with padding), swap-in misses."""
    gen = torch.Generator().manual_seed(21)
    spec = [(0, 300, 14), (0, 90, 20), (1, 200, 9), (3, 150, 16), (4, 260, 12), (6, 40, 18), (9, 180, 10),
            (12, 220, 8)]
    return [Arrival(step, f"g{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def graph_runs(parallel: ParallelState, device: str) -> dict[str, dict]:
    """Per mode (dense, HiSparse) and variant: "graphs" (captured, replayed) and "eager" (the same padded batches
    not captured): tokens, logits, replay / eager counts, swap-in misses, whether the engine ended idle."""
    model = build_random_model(wide_config(), device, torch.bfloat16, seed=3, parallel=parallel)
    tiny = (model, wide_config(), Tokenizer.from_dir(resolve_model_path("tiny-dsa")))
    out: dict[str, dict] = {}
    for hisparse in (False, True):
        for graphs in (True, False):
            buckets = {"cuda_graph_bs": BUCKETS} if graphs else {"eager_graph_buckets": BUCKETS}
            engine = make_engine(tiny, hisparse=hisparse, device="cuda", buffer_size=WIDE_TOP_K, max_running=8,
                                 chunk=512, parallel=parallel, **buckets)
            runner = engine.graph_runner
            assert runner is not None and engine.overlap, "graphs / overlap scheduling were meant to be on"
            if graphs:
                assert runner.captured == BUCKETS, engine.cuda_graph_error
            result = run_script(engine, graph_arrivals())
            out[f"{'hisparse' if hisparse else 'dense'}_{'graphs' if graphs else 'eager'}"] = {
                "tokens": result.tokens, "logits": result.logits, "replays": runner.num_replays,
                "eager": runner.num_eager, "misses": engine.stats().hisparse_misses if hisparse else 0,
                "idle": engine.is_idle_and_empty(),
            }
            del engine, runner
            torch.cuda.empty_cache()
    return out


def graph_rank(rank: int, init_method: str, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    tp = init_parallel(rank, WORLD, 1, init_method, device, timeout_s=180)
    ep = dataclasses.replace(tp, ep_size=WORLD)
    try:
        results = {"tp": graph_runs(tp, str(device)), "ep": graph_runs(ep, str(device))}
    finally:
        destroy_parallel(tp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
