"""What each rank runs in tests/parallel/test_tp_overlap.py: tiny-dsa's tensor-parallel shard through the real
Engine with its parallel state (HiSparse on the node's one shared host pool, the per-step barriers), on CPU over
gloo, in batch-invariant mode, synchronous and with overlap scheduling forced on, under budgets tight enough to
retract, with aborts landing while a pass is in flight (tests/hisparse/test_overlap.py's workload)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

_TESTS = Path(__file__).resolve().parents[1]
if str(_TESTS / "hisparse") not in sys.path:
    sys.path.append(str(_TESTS / "hisparse"))

from harness import PAGE, make_engine  # noqa: E402
from test_lossless import tight_hisparse_budget  # noqa: E402
from test_overlap import DENSE_ROW, drive, retraction_jobs  # noqa: E402

from decode_server.model import Tokenizer, load_model, resolve_model_path  # noqa: E402
from decode_server.parallel.state import destroy_parallel, init_parallel  # noqa: E402

WORLD = 2


def lockstep_runs(parallel) -> dict[str, dict]:
    """Per mode (dense, HiSparse): the outcomes of every request synchronous and overlapped, and the overlapped
    engine's retractions, dropped tokens and whether it ended idle (drive() asserts it too)."""
    model, config = load_model("tiny-dsa", "cpu", torch.float32, parallel=parallel)
    tiny = (model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa")))
    jobs = retraction_jobs(seed=9)
    out: dict[str, dict] = {}
    for hisparse in (False, True):
        budget = (dict(device_budget=tight_hisparse_budget(3, 10), host_budget=64 << 20) if hisparse
                  else dict(device_budget=12 * PAGE * DENSE_ROW))  # fmt: skip
        runs = {}
        for overlap in (False, True):
            engine = make_engine(tiny, hisparse=hisparse, overlap=overlap, deterministic=True, optimistic=True,
                                 max_running=5, chunk=96, parallel=parallel, **budget)
            assert engine.overlap is overlap and engine.tp_size == WORLD
            outcomes = drive(engine, jobs)
            stats = engine.stats()
            runs["overlap" if overlap else "sync"] = {
                "outcomes": {rid: dataclasses.asdict(o) for rid, o in outcomes.items()},
                "retractions": stats.num_retractions, "discarded": engine.num_discarded_tokens,
                "idle": engine.is_idle_and_empty(),
            }
            del engine
        out["hisparse" if hisparse else "dense"] = runs
    return out


def overlap_rank(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_parallel(rank, WORLD, 1, init_method, torch.device("cpu"), timeout_s=120)
    try:
        results = lockstep_runs(tp)
    finally:
        destroy_parallel(tp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def capture_agreement_rank(rank: int, init_method: str, out_dir: str) -> None:
    """`build_graph_runner` on 2 CPU ranks with graphs forced "on" and rank 1's capture failing: what each rank
    ends with (tests/parallel/test_tp_overlap.py `test_a_capture_failure_on_one_rank_makes_every_rank_eager`)."""
    from types import SimpleNamespace
    from unittest import mock

    from decode_server.config import EngineConfig
    from decode_server.engine import cuda_graph

    tp = init_parallel(rank, WORLD, 1, init_method, torch.device("cpu"), timeout_s=120)

    def capture(self, buckets=None):
        if rank == 1:
            raise RuntimeError("capture failed here")

    engine = SimpleNamespace(config=EngineConfig(cuda_graph_bs=[1, 2]), kv=SimpleNamespace(
        backend=SimpleNamespace(scratch_row=8)), device=torch.device("cpu"), model_dtype=torch.bfloat16, parallel=tp,
        dp_attention=False, tp_size=WORLD, model=None, context_length=64)
    try:
        with mock.patch.object(cuda_graph, "graphs_off_reason", return_value=None), \
                mock.patch.object(cuda_graph.DecodeGraphRunner, "capture", capture):
            runner, error = cuda_graph.build_graph_runner(engine)
    finally:
        destroy_parallel(tp)
    torch.save({"runner": runner is not None, "error": error}, Path(out_dir) / f"rank{rank}.pt")
