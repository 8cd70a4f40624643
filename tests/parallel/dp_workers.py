"""What 2 data-parallel-attention ranks run on CPU (gloo over 127.0.0.1), spawned by tp_workers.run_ranks.

Each rank serves different requests: at the model level a batch of its own prompts (rank 1's finishes early and
then runs idle passes), at the engine level its own arrivals through the real `Engine` (dense and HiSparse).
Results are saved per rank; the test compares each rank with one device running that rank's requests alone.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
import torch.distributed as dist

_TESTS = Path(__file__).resolve().parents[1]
for _sub in ("model", "hisparse", "parallel"):
    if str(_TESTS / _sub) not in sys.path:
        sys.path.append(str(_TESTS / _sub))

from dsa_test_helpers import forward_tokens  # noqa: E402
from harness import PAGE, TOP_K, Arrival, random_prompt  # noqa: E402
from tp_workers import WORLD, recording_backend  # noqa: E402

from decode_server.config import EngineConfig, HiSparseConfig  # noqa: E402
from decode_server.engine.cuda_graph import DecodeGraphRunner  # noqa: E402
from decode_server.engine.engine import Engine  # noqa: E402
from decode_server.engine.sampling_params import SamplingParams  # noqa: E402
from decode_server.model import Tokenizer, load_model, resolve_model_path  # noqa: E402
from decode_server.parallel.dp_attention import (  # noqa: E402
    DPStepSync,
    dp_batch,
    gather_rows,
    reduce_scatter_rows,
)
from decode_server.parallel.state import ParallelState, destroy_parallel, init_parallel  # noqa: E402

STEPS = 5
IDLE_FROM = 3  # rank 1 decodes this many tokens, then idles while rank 0 goes on to STEPS


def rank_prompts(rank: int, vocab: int = 1024) -> list[list[int]]:
    """Rank 0: two prompts (one longer than index_topk, 64); rank 1: one longer and one short."""
    gen = torch.Generator().manual_seed(7 + rank)
    lengths = ((80, 23), (70, 12))[rank]
    return [random_prompt(gen, n, vocab) for n in lengths]


def rank_steps(rank: int) -> int:
    return STEPS if rank == 0 else IDLE_FROM


def dp_greedy(model, backend, state: ParallelState, batch: list[list[int]], steps: int,
              total_steps: int) -> dict[str, torch.Tensor]:  # fmt: skip
    """`batch_greedy` of tp_workers for one DP rank: every pass agrees on everyone's counts first; after `steps`
    passes of its own this rank runs idle passes (no token) until `total_steps`."""
    sync = DPStepSync(state)
    rows = list(range(len(batch)))
    for row, prompt in zip(rows, batch, strict=True):
        backend.reserve(row, len(prompt) + steps)
    tokens: list[torch.Tensor] = []
    logits: list[torch.Tensor] = []
    idle = 0
    for step in range(total_steps):
        if step >= steps:
            layout = sync.agree(0, 0)
            with dp_batch(layout):
                empty = torch.empty(0, dtype=torch.int64)
                out = model.compute_logits(model(empty, empty))
            assert out.shape == (0, model.config.vocab_size)
            idle += 1
            continue
        if step == 0:
            prefix, chunks = [0] * len(batch), batch
            last = torch.tensor([len(p) for p in batch]).cumsum(0) - 1
        else:
            prefix, chunks = [len(p) + step - 1 for p in batch], [[int(t)] for t in tokens[-1]]
            last = torch.arange(len(batch))
        layout = sync.agree(sum(len(c) for c in chunks), len(batch))
        with dp_batch(layout):
            hidden = forward_tokens(model, backend, rows, prefix, chunks)
            logits.append(model.compute_logits(hidden[last]))
        tokens.append(logits[-1].argmax(-1))
    for row in rows:
        backend.release(row)
    return {"tokens": torch.stack(tokens, 1), "logits": torch.stack(logits, 1), "idle": idle}


def model_run_dp(name: str, state: ParallelState) -> dict[str, torch.Tensor]:
    model, config = load_model(name, "cpu", torch.float32, parallel=state)
    rank = state.dp_rank
    return dp_greedy(model, recording_backend(config), state, rank_prompts(rank, config.vocab_size),
                     rank_steps(rank), STEPS)


def rank_arrivals(rank: int) -> list[Arrival]:
    """Engine workload per rank: rank 0 three requests at different steps (one prompt in two prefill chunks),
    rank 1 one short request, so it is idle for most of rank 0's passes."""
    gen = torch.Generator().manual_seed(11 + rank)
    spec = [[(0, 90, 6), (0, 30, 8), (2, 72, 5)], [(1, 70, 3)]][rank]
    return [Arrival(step, f"r{rank}-{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def engine_config(hisparse: bool, parallel: ParallelState | None, deterministic: bool = False) -> EngineConfig:
    """The settings of tests/hisparse/harness.make_engine, as one DP rank (or one device when `parallel` is None)."""
    dp = {} if parallel is None else {"tp_size": WORLD, "dp_size": WORLD, "enable_dp_attention": True,
                                      "ep_size": parallel.ep_size}
    return EngineConfig(
        device="cpu", enable_hisparse=hisparse, page_size=PAGE, chunked_prefill_size=64,
        hisparse=HiSparseConfig(device_buffer_size=TOP_K, num_recent_slots=2), device_kv_budget_bytes=64 << 20,
        max_running_requests=8, enable_deterministic_inference=deterministic, **dp,
    )


def run_engine(engine: Engine, arrivals: list[Arrival], parallel: ParallelState | None) -> dict:
    """Drive `engine` through `arrivals`; with DP every rank steps until every rank is done (an all-reduce of
    'still busy' per iteration: the test's own agreement, as the runtime's loop keeps ranks stepping)."""
    tokens: dict[str, list[int]] = {a.rid: [] for a in arrivals}
    logits: dict[str, list[torch.Tensor]] = {}

    def hook(rids: list[str], batch_logits: torch.Tensor) -> None:
        for i, rid in enumerate(rids):
            logits.setdefault(rid, []).append(batch_logits[i].clone())

    engine.logits_hook = hook
    pending = sorted(arrivals, key=lambda a: a.step)
    step = 0
    while True:
        busy = bool(pending) or engine.has_unfinished_requests()
        if parallel is not None:
            flag = torch.tensor([int(busy)])
            dist.all_reduce(flag, group=parallel.cpu_group)
            busy = bool(flag.item())
        if not busy:
            break
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.rid, a.prompt, SamplingParams(max_tokens=a.max_tokens, temperature=0.0))
        for delta in engine.step():
            tokens[delta.rid].extend(delta.new_token_ids)
        step += 1
        assert step < 1000, "the engine did not finish"
    stats = engine.stats()
    return {"tokens": tokens, "logits": logits, "misses": stats.hisparse_misses, "idle": engine.is_idle_and_empty(),
            "idle_passes": stats.num_idle_passes, "steps": stats.num_steps}


def engine_runs_dp(parallel: ParallelState) -> dict[str, dict]:
    model, config = load_model("tiny-dsa", "cpu", torch.float32, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        engine = Engine(engine_config(hisparse, parallel), model=model, model_config=config, tokenizer=tokenizer,
                        parallel=parallel)
        out["hisparse" if hisparse else "dense"] = run_engine(engine, rank_arrivals(parallel.dp_rank), parallel)
    return out


PADDED_BUCKETS = [1, 2, 4, 8]


def attach_padded_runner(engine: Engine, buckets: list[int]) -> list[tuple[int, int]]:
    """Give a DP rank's engine a decode graph runner over `buckets` that captures nothing: the padded forward that
    graphs capture, run eagerly (CPU; the comparison run on GPUs). Returns `record_padded`'s list."""
    parallel = engine.parallel
    engine.graph_runner = DecodeGraphRunner(engine.model, engine.kv.backend, engine.device, buckets,
                                            engine.context_length, dp=(parallel.dp_rank, parallel.dp_size))
    return record_padded(engine.graph_runner)


def record_padded(runner: DecodeGraphRunner) -> list[tuple[int, int]]:
    """Record (bucket, real rows) of every padded pass of `runner`, so a test can check that the ranks padded every
    pass to the same bucket."""
    record: list[tuple[int, int]] = []
    run_static = runner._run_static

    def recording(static, bs: int, num_real: int):
        record.append((bs, num_real))
        return run_static(static, bs, num_real)

    runner._run_static = recording
    return record


def engine_runs_dp_padded(parallel: ParallelState) -> dict[str, dict]:
    """`engine_runs_dp` with decode passes padded to buckets that every rank agrees on (the CUDA-graph path of DP
    attention, run eagerly on CPU): what each rank padded to, and its passes of padding rows only."""
    model, config = load_model("tiny-dsa", "cpu", torch.float32, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        engine = Engine(engine_config(hisparse, parallel), model=model, model_config=config, tokenizer=tokenizer,
                        parallel=parallel)
        record = attach_padded_runner(engine, PADDED_BUCKETS)
        result = run_engine(engine, rank_arrivals(parallel.dp_rank), parallel)
        result.update(padded=record, padded_idle=engine.graph_runner.num_idle)
        out["hisparse" if hisparse else "dense"] = result
    return out


def engine_runs_dp_overlap(parallel: ParallelState) -> dict[str, dict]:
    """Each DP rank its own share of test_overlap.py's retraction workload (tight budgets, aborts in flight),
    synchronous and with overlap scheduling forced on, in batch-invariant mode, dense and HiSparse."""
    from test_lossless import tight_hisparse_budget
    from test_overlap import DENSE_ROW, drive, retraction_jobs

    model, config = load_model("tiny-dsa", "cpu", torch.float32, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    jobs = retraction_jobs(seed=9 + parallel.dp_rank, num=10 - 4 * parallel.dp_rank)  # rank 1: less work
    out: dict[str, dict] = {}
    for hisparse in (False, True):
        budget = ({"device_kv_budget_bytes": tight_hisparse_budget(3, 10), "host_kv_budget_bytes": 64 << 20}
                  if hisparse else {"device_kv_budget_bytes": 12 * PAGE * DENSE_ROW})
        for overlap in (False, True):
            cfg = engine_config(hisparse, parallel, deterministic=True).model_copy(update={
                "max_running_requests": 5, "chunked_prefill_size": 96, "force_overlap_schedule": overlap,
                "disable_overlap_schedule": not overlap, **budget})
            engine = Engine(cfg, model=model, model_config=config, tokenizer=tokenizer, parallel=parallel)
            assert engine.overlap is overlap
            sched = engine.scheduler  # optimistic admission: requests grow past what was reserved, so retract
            sched.new_token_ratio = sched.min_new_token_ratio = sched.new_request_ratio = 0.0
            outcomes = {rid: dataclasses.asdict(o) for rid, o in drive(engine, jobs, parallel=parallel).items()}
            stats = engine.stats()
            out[f"{'hisparse' if hisparse else 'dense'}_{'overlap' if overlap else 'sync'}"] = {
                "outcomes": outcomes, "retractions": stats.num_retractions, "idle": engine.is_idle_and_empty(),
                "idle_passes": stats.num_idle_passes,
            }
    return out


def engine_runs_single(rank: int) -> dict[str, dict]:
    """What one device computes for rank `rank`'s arrivals alone (dense and HiSparse)."""
    model, config = load_model("tiny-dsa", "cpu", torch.float32)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        engine = Engine(engine_config(hisparse, None), model=model, model_config=config, tokenizer=tokenizer)
        out["hisparse" if hisparse else "dense"] = run_engine(engine, rank_arrivals(rank), None)
    return out


def collectives(state: ParallelState) -> dict[str, list]:
    """gather_rows / reduce_scatter_rows in both padding modes, with uneven and empty counts."""
    out: dict[str, list] = {}
    for counts in ((3, 3), (5, 2), (0, 4), (4, 0)):
        mine = counts[state.dp_rank]
        x = torch.arange(mine * 2, dtype=torch.float32).view(mine, 2) + 100 * state.dp_rank
        for max_len in (True, False):
            gathered = gather_rows(x, counts, state.dp_rank, state, max_len=max_len)
            # every rank's partial of every row: row values times (rank + 1); the sum is 3 × the row (2 ranks)
            partial = gathered * (state.dp_rank + 1)
            back = reduce_scatter_rows(partial.clone(), counts, state.dp_rank, state, max_len=max_len)
            out.setdefault(f"{counts}", []).append((gathered, back, x))
    return out


def dp_scenarios(rank: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dp = init_parallel(rank, WORLD, 1, init_method, torch.device("cpu"), timeout_s=120, dp_size=WORLD)
    ep = dataclasses.replace(dp, ep_size=WORLD)
    lm_head = dataclasses.replace(ep, enable_dp_lm_head=True)
    try:
        results = {
            "collectives": collectives(dp),
            "dp": model_run_dp("tiny-dsa", dp),
            "dp_ep": model_run_dp("tiny-dsa", ep),
            "dp_lm_head": model_run_dp("tiny-dsa", lm_head),
            "glm5_ep": model_run_dp("tiny-glm5", ep),
            "engine": engine_runs_dp(ep),
            "engine_padded": engine_runs_dp_padded(ep),
            "engine_overlap": engine_runs_dp_overlap(ep),
        }
    finally:
        destroy_parallel(dp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


# ---------------------------------------------------------------------------------------------- 2 GPUs (NCCL)


def gpu_rank_arrivals(rank: int, wide: bool) -> list[Arrival]:
    """Each rank's share of the 2-GPU workload; the wide model's prompts are longer than its top-k (128)."""
    if not wide:
        return rank_arrivals(rank)
    gen = torch.Generator().manual_seed(13 + rank)
    spec = [[(0, 300, 6), (2, 260, 5)], [(0, 150, 8)]][rank]
    return [Arrival(step, f"w{rank}-{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def gpu_engine_runs(parallel: ParallelState | None, device: str, rank: int, wide: bool,
                    float32: bool = False) -> dict[str, dict]:
    """Rank `rank`'s arrivals through the real Engine on `device` in bf16, dense and HiSparse: as one DP rank
    (`parallel`) or on one GPU alone (None). Eager and without overlap on both sides (DP runs neither).
    `float32` (wide only): in float32 on the PyTorch reference kernels, for the exact comparison with one GPU."""
    from tp_gpu_workers import WIDE_TOP_K, wide_config

    from decode_server.model import build_random_model

    if wide:
        config = wide_config()
        model = build_random_model(config, device, torch.float32 if float32 else torch.bfloat16, seed=3,
                                   parallel=parallel)
    else:
        model, config = load_model("tiny-dsa", device, torch.bfloat16, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        base = engine_config(hisparse, parallel)
        cfg = base.model_copy(update={
            "device": "cuda", "disable_cuda_graph": True, "disable_overlap_schedule": True,
            "attention_backend": "auto" if wide and not float32 else "torch_native",
            "hisparse": HiSparseConfig(device_buffer_size=WIDE_TOP_K if wide else TOP_K, num_recent_slots=2),
        })
        engine = Engine(cfg, model=model, model_config=config, tokenizer=tokenizer, parallel=parallel)
        out["hisparse" if hisparse else "dense"] = run_engine(engine, gpu_rank_arrivals(rank, wide), parallel)
        del engine
        torch.cuda.empty_cache()
    return out


def gpu_dp_scenarios(rank: int, init_method: str, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    dp = init_parallel(rank, WORLD, WORLD, init_method, device, timeout_s=180, dp_size=WORLD)
    try:
        results = {"dp_ep": gpu_engine_runs(dp, str(device), rank, wide=False),
                   "wide_dp_ep": gpu_engine_runs(dp, str(device), rank, wide=True),
                   "wide_dp_ep_fp32": gpu_engine_runs(dp, str(device), rank, wide=True, float32=True),
                   "backend": dist.get_backend()}
    finally:
        destroy_parallel(dp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def graph_arrivals(rank: int) -> list[Arrival]:
    """Rank 0: three requests (decode batches of 1 to 3, one joining mid-way); rank 1: one short one, so it replays
    passes of padding rows only for most of rank 0's; prompts longer than the wide model's top-k (128)."""
    gen = torch.Generator().manual_seed(17 + rank)
    spec = [[(0, 300, 12), (2, 260, 10), (3, 200, 9)], [(0, 150, 5)]][rank]
    return [Arrival(step, f"g{rank}-{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def gpu_graph_runs(parallel: ParallelState, device: str, rank: int) -> dict[str, dict]:
    """Wide tiny-dsa in bf16 on the GPU kernels as one DP rank (EP over the ranks), dense and HiSparse, with CUDA
    graphs captured over PADDED_BUCKETS ("graphs") and with the same padded passes run eagerly ("eager")."""
    from tp_gpu_workers import WIDE_TOP_K, wide_config

    from decode_server.model import build_random_model

    config = wide_config()
    model = build_random_model(config, device, torch.bfloat16, seed=3, parallel=parallel)
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny-dsa"))
    out = {}
    for hisparse in (False, True):
        for graphs in (True, False):
            cfg = engine_config(hisparse, parallel).model_copy(update={
                "device": "cuda", "disable_cuda_graph": not graphs, "cuda_graph_bs": PADDED_BUCKETS,
                "hisparse": HiSparseConfig(device_buffer_size=WIDE_TOP_K, num_recent_slots=2),
            })
            engine = Engine(cfg, model=model, model_config=config, tokenizer=tokenizer, parallel=parallel)
            if graphs:
                assert engine.graph_runner is not None, engine.cuda_graph_error
                assert engine.graph_runner.captured == PADDED_BUCKETS
                record = record_padded(engine.graph_runner)
            else:
                record = attach_padded_runner(engine, PADDED_BUCKETS)
            runner = engine.graph_runner
            result = run_engine(engine, graph_arrivals(rank), parallel)
            result.update(padded=record, padded_idle=runner.num_idle, replays=runner.num_replays,
                          eager=runner.num_eager)
            out[f"{'hisparse' if hisparse else 'dense'}_{'graphs' if graphs else 'eager'}"] = result
            # As the runtime does before leaving the group: the graphs hold NCCL collectives, and record_padded's
            # wrapper keeps the runner alive, so without this destroy_process_group waits forever (seen on 2 H200s).
            engine.close()
            del engine, runner
            torch.cuda.empty_cache()
    return out


def gpu_dp_graph_scenarios(rank: int, init_method: str, out_dir: str) -> None:
    device = torch.device("cuda", rank)
    dp = init_parallel(rank, WORLD, WORLD, init_method, device, timeout_s=180, dp_size=WORLD)
    try:
        results = {"wide_dp_ep": gpu_graph_runs(dp, str(device), rank)}
    finally:
        destroy_parallel(dp)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
