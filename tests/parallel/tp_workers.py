"""Running model code on 2 tensor-parallel ranks on CPU (gloo over 127.0.0.1), and what the ranks run.

`run_ranks` spawns one process per rank (torch.multiprocessing, spawn), each joins the group through
`decode_server.parallel.state.init_parallel` and runs `rank_scenarios`, which saves its results to
`<out_dir>/rank<R>.pt`; the test process compares them with a single-device run of the same workload.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

_TESTS = Path(__file__).resolve().parents[1]
for _sub in ("model", "hisparse", "api"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.append(str(_TESTS / _sub))

from api_server_harness import free_port  # noqa: E402  (below the ephemeral range: see there)
from dsa_test_helpers import forward_tokens  # noqa: E402
from harness import Arrival, make_engine, random_prompt, run_script  # noqa: E402

from decode_server.engine.dense_backend import DenseBackend, DenseKVCache  # noqa: E402
from decode_server.engine.kv_rows import CacheGeometry  # noqa: E402
from decode_server.model import Tokenizer, load_model, resolve_model_path  # noqa: E402
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel  # noqa: E402

WORLD = 2
STEPS = 5


def prompts(vocab: int = 1024) -> list[list[int]]:
    """Three prompts, two longer than index_topk (64), so the top-k really selects."""
    gen = torch.Generator().manual_seed(7)
    return [random_prompt(gen, n, vocab) for n in (80, 23, 70)]


def arrivals() -> list[Arrival]:
    """Engine workload: requests joining at different steps, one prompt in two prefill chunks (chunk 64)."""
    gen = torch.Generator().manual_seed(11)
    spec = [(0, 90, 6), (0, 30, 8), (2, 72, 5)]
    return [Arrival(step, f"r{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


class RecordingDense(DenseBackend):
    """The engine's dense backend, keeping a copy of every latent row written and every top-k attended."""

    def __init__(self, cache: DenseKVCache) -> None:
        super().__init__(cache)
        self.rows: list[torch.Tensor] = []
        self.topk: list[torch.Tensor] = []

    def write_kv(self, layer_id: int, kv_rows: torch.Tensor) -> None:
        self.rows.append(kv_rows.detach().clone())
        super().write_kv(layer_id, kv_rows)

    def sparse_attention(self, layer_id, q, topk_positions, softmax_scale):
        self.topk.append(topk_positions.detach().clone())
        return super().sparse_attention(layer_id, q, topk_positions, softmax_scale)


def recording_backend(config) -> RecordingDense:
    cache = DenseKVCache(config.num_hidden_layers, 4096, 8, 1024, torch.float32, "cpu",
                         geometry=CacheGeometry.from_model_config(config))
    return RecordingDense(cache)


def batched_greedy(model, backend, batch: list[list[int]], steps: int = STEPS) -> dict[str, torch.Tensor]:
    """All prompts prefilled in one pass, then decoded together greedily: tokens [B, steps], logits
    [B, steps, V], plus the backend's recorded latent rows and top-k (concatenated in call order)."""
    rows = list(range(len(batch)))
    for row, prompt in zip(rows, batch, strict=True):
        backend.reserve(row, len(prompt) + steps)
    hidden = forward_tokens(model, backend, rows, [0] * len(batch), batch)
    last = torch.tensor([len(p) for p in batch]).cumsum(0) - 1
    logits = [model.compute_logits(hidden[last])]
    tokens = [logits[-1].argmax(-1)]
    for step in range(1, steps):
        prefix = [len(p) + step - 1 for p in batch]
        hidden = forward_tokens(model, backend, rows, prefix, [[int(t)] for t in tokens[-1]])
        logits.append(model.compute_logits(hidden))
        tokens.append(logits[-1].argmax(-1))
    for row in rows:
        backend.release(row)
    return {
        "tokens": torch.stack(tokens, 1), "logits": torch.stack(logits, 1),
        "rows": torch.cat([r.flatten() for r in backend.rows]),
        "topk": torch.cat([t.flatten() for t in backend.topk]),
    }


def model_run(name: str, parallel: ParallelState | None) -> dict[str, torch.Tensor]:
    model, config = load_model(name, "cpu", torch.float32, parallel=parallel)
    return batched_greedy(model, recording_backend(config), prompts(config.vocab_size))


def engine_runs(parallel: ParallelState | None) -> dict[str, dict]:
    """tiny-dsa through the real Engine, HiSparse off and on (device buffer 64 rows < the prompts)."""
    model, config = load_model("tiny-dsa", "cpu", torch.float32, parallel=parallel)
    tiny = (model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa")))
    out = {}
    for hisparse in (False, True):
        engine = make_engine(tiny, hisparse=hisparse)
        result = run_script(engine, arrivals())
        out["hisparse" if hisparse else "dense"] = {
            "tokens": result.tokens, "logits": result.logits,
            "misses": engine.stats().hisparse_misses if hisparse else 0, "idle": engine.is_idle_and_empty(),
        }
    return out


def rank_scenarios(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    tp = init_parallel(rank, WORLD, 1, init_method, torch.device("cpu"), timeout_s=120)
    ep = dataclasses.replace(tp, ep_size=WORLD)
    try:
        results = {
            "tp": model_run("tiny-dsa", tp),
            "ep": model_run("tiny-dsa", ep),
            "glm5": model_run("tiny-glm5", tp),
            "glm5_ep": model_run("tiny-glm5", ep),
            "engine": engine_runs(tp),
        }
    finally:
        destroy_parallel(tp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")




def _run_then_exit(rank: int, fn, init_method: str, out_dir: str) -> None:
    """fn(rank, init_method, out_dir), then leave the process at once (exit code 0), skipping the interpreter's
    teardown. Why: fn has saved its results and left the process group, but the gloo backend's worker threads can
    still be torn down during interpreter finalization, which aborts the process now and then ("terminate called
    without an active exception", SIGABRT: CI on 2026-11-27, after both ranks had written their results; PyTorch
    pull request 179291 describes the same teardown). An exception in fn still propagates, so the spawn wrapper
    reports it and the rank exits non-zero."""
    fn(rank, init_method, out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, out_dir: Path, timeout_s: float = 300.0) -> list[dict]:
    """Spawn WORLD ranks running fn(rank, init_method, out_dir); every rank must exit 0 within timeout_s
    (a rank left waiting in a collective is killed, never orphaned). Returns each rank's saved results."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    context = mp.start_processes(_run_then_exit, args=(fn, init_method, str(out_dir)), nprocs=WORLD, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
