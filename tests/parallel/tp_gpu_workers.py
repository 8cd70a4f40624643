"""What each rank runs in the 2-GPU tensor/expert-parallel test (tests/parallel/test_tp_gpu.py): tiny-dsa through
the real Engine on `cuda:<rank>` in bf16, NCCL between the ranks, HiSparse off and on, with TP=2 (MoE experts
tensor-sharded) and with EP=2 (experts split across the ranks). Two models: tiny-dsa itself (16 heads, 8 per rank:
below the GPU kernels' minimum, so it runs the PyTorch reference kernels on the GPU) and "wide" tiny-dsa (64
heads, top-k 128, random weights: 32 heads per rank, the real Triton/FlashMLA and swap-in kernels), the latter
also in float32 on the PyTorch reference kernels for the comparison with one GPU."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS / "hisparse") not in sys.path:
    sys.path.append(str(_TESTS / "hisparse"))

from harness import PAGE, TOP_K, Arrival, random_prompt, run_script  # noqa: E402
from tp_workers import arrivals  # noqa: E402

from decode_server.config import EngineConfig, HiSparseConfig  # noqa: E402
from decode_server.engine.engine import Engine  # noqa: E402
from decode_server.model import (  # noqa: E402
    Tokenizer,
    build_random_model,
    load_config,
    load_model,
    resolve_model_path,
)
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel  # noqa: E402

WORLD = 2


WIDE_TOP_K = 128


def wide_arrivals() -> list[Arrival]:
    """Prompts longer than the wide model's top-k (128), so that selection and swap-in misses really happen."""
    gen = torch.Generator().manual_seed(13)
    spec = [(0, 300, 6), (0, 150, 8), (2, 260, 5)]
    return [Arrival(step, f"w{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def make_rank_engine(model, config, tokenizer, parallel: ParallelState | None, hisparse: bool,
                     wide: bool, device_type: str = "cuda", reference: bool = False) -> Engine:
    """The serving path of one rank (on the PyTorch reference kernels, run on the GPU): the engine gets the rank's parallel state (its GPU, the budgets agreed by
    all ranks, HiSparse's one shared host pool registered with every rank's GPU). Eager and without overlap: TP>1
    runs neither, and TP=1 is run the same way so both sides launch the same kernels."""
    cfg = EngineConfig(
        device=device_type, enable_hisparse=hisparse, page_size=PAGE, chunked_prefill_size=64,
        hisparse=HiSparseConfig(device_buffer_size=WIDE_TOP_K if wide else TOP_K, num_recent_slots=2),
        device_kv_budget_bytes=64 << 20, max_running_requests=8, max_queued_requests=1024, disable_cuda_graph=True,
        disable_overlap_schedule=True,
        # tiny-dsa: 8 heads per rank, below the kernels' 16; `reference`: float32, which the GPU kernels do not take
        attention_backend="auto" if wide and not reference else "torch_native",
        tp_size=parallel.tp_size if parallel is not None else 1, ep_size=parallel.ep_size if parallel else 1,
    )
    return Engine(cfg, model=model, model_config=config, tokenizer=tokenizer, parallel=parallel)


def wide_config():
    """tiny-dsa with 64 heads and top-k 128: the GPU kernels' shapes (32 heads a rank at TP 2)."""
    return dataclasses.replace(load_config("tiny-dsa"), num_attention_heads=64, num_key_value_heads=64,
                               index_topk=WIDE_TOP_K)


def gpu_engine_runs(parallel: ParallelState | None, device: str, wide: bool = False,
                    float32: bool = False) -> dict[str, dict]:
    """Dense and HiSparse engines on one device (this rank's GPU). `float32` (wide only): the same random model
    in float32 on the PyTorch reference kernels, where the comparison with one GPU is exact up to float32
    rounding (test_tp_gpu.py `test_greedy_tokens_match_one_gpu` says why bf16 is not)."""
    if wide:
        config = wide_config()
        model = build_random_model(config, device, torch.float32 if float32 else torch.bfloat16, seed=3,
                                   parallel=parallel)
    else:
        model, config = load_model("tiny-dsa", device, torch.bfloat16, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        engine = make_rank_engine(model, config, tokenizer, parallel, hisparse, wide, torch.device(device).type,
                                  reference=float32)
        result = run_script(engine, wide_arrivals() if wide else arrivals())
        out["hisparse" if hisparse else "dense"] = {
            "tokens": result.tokens, "logits": result.logits,
            "misses": engine.stats().hisparse_misses if hisparse else 0, "idle": engine.is_idle_and_empty(),
        }
        del engine
        torch.cuda.empty_cache()
    return out


def gpu_rank_scenarios(rank: int, init_method: str, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    tp = init_parallel(rank, WORLD, 1, init_method, device, timeout_s=180)
    ep = dataclasses.replace(tp, ep_size=WORLD)
    try:
        results = {"tp": gpu_engine_runs(tp, str(device)), "ep": gpu_engine_runs(ep, str(device)),
                   "wide_tp": gpu_engine_runs(tp, str(device), wide=True),
                   "wide_ep": gpu_engine_runs(ep, str(device), wide=True),
                   "wide_tp_fp32": gpu_engine_runs(tp, str(device), wide=True, float32=True),
                   "wide_ep_fp32": gpu_engine_runs(ep, str(device), wide=True, float32=True),
                   "backend": torch.distributed.get_backend()}
    finally:
        destroy_parallel(tp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
