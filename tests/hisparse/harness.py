"""Drive dense and HiSparse engines through the same scripted workload and record tokens and logits."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import pytest
import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.cuda_graph import DecodeGraphRunner
from decode_server.engine.engine import Engine
from decode_server.engine.request import RequestStatus
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.scheduler import ScheduledBatch
from decode_server.parallel.state import ParallelState

TOP_K = 64  # tiny-dsa's index_topk
PAGE = 16


@dataclass
class Arrival:
    step: int
    rid: str
    prompt: list[int]
    max_tokens: int
    abort_at_step: int | None = None


@dataclass
class RunResult:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    finish: dict[str, str | None] = field(default_factory=dict)
    selected_per_layer: list[int] = field(default_factory=list)
    schedule: list[tuple[list[str], list[int], list[int], bool] | None] = field(default_factory=list)


def make_engine(
    tiny, *, hisparse: bool, device: str = "cpu", device_budget: int | None = 64 << 20,
    host_budget: int | None = None, buffer_size: int = TOP_K, num_recent: int = 2, max_running: int = 8,
    chunk: int = 64, max_queued: int = 1024, kv_cache_dtype: str = "auto", attention_backend: str = "auto",
    optimistic: bool = False, prefill_staging_tokens: int | None = None, disable_cuda_graph: bool = False,
    cuda_graph_bs: list[int] | None = None, eager_graph_buckets: list[int] | None = None,
    overlap: bool | None = None, deterministic: bool = False, prefetch_shared_layers: bool = False,
    early_swap_in: bool = False, side_stream_copy_blocks: int | str = 0, speculative_prefetch: bool = False,
    prefix_caching: bool = False, json_any_whitespace: bool = True, parallel: ParallelState | None = None,
) -> Engine:
    """`optimistic`: admission expects no request to grow past its prompt (new-token ratios 0), so that tight
    budgets force retractions. CUDA graphs follow the engine's defaults (captured on CUDA, none on CPU) and
    `disable_cuda_graph` / `cuda_graph_bs`; `eager_graph_buckets`: instead of graphs, run decode batches padded to
    these buckets through the graph runner's eager path (the very forward that graphs capture, not captured).
    `overlap`: force overlap scheduling on (True) or off (False); None: the device's default. `deterministic`:
    batch-invariant mode (a request's results do not depend on its batch). `prefetch_shared_layers`: the
    HiSparseConfig key (GLM-5 shared layers' swap-ins started at their full layer); `early_swap_in`: the
    HiSparseConfig key (a layer's swap-in started from its prepare_attention, on a side stream);
    `side_stream_copy_blocks`: the HiSparseConfig key (those side-stream swap-ins' copy grid cap);
    `speculative_prefetch`: the HiSparseConfig key (each full layer's top-k swapped into the next one's buffer);
    `prefix_caching`: `--enable-prefix-caching`; `json_any_whitespace=False`:
    `--constrained-json-disable-any-whitespace`; `parallel`: this rank's tensor-parallel state (the model must be
    that rank's shard; HiSparse then maps the node's one shared host pool)."""
    model, model_config, tokenizer = tiny
    cfg = EngineConfig(
        device=device, enable_hisparse=hisparse, page_size=PAGE, chunked_prefill_size=chunk,
        hisparse=HiSparseConfig(device_buffer_size=buffer_size, num_recent_slots=num_recent,
                                prefill_staging_tokens=prefill_staging_tokens,
                                prefetch_shared_layers=prefetch_shared_layers, early_swap_in=early_swap_in,
                                side_stream_copy_blocks=side_stream_copy_blocks,
                                speculative_prefetch=speculative_prefetch),
        device_kv_budget_bytes=device_budget, host_kv_budget_bytes=host_budget,
        max_running_requests=max_running, max_queued_requests=max_queued, kv_cache_dtype=kv_cache_dtype,
        attention_backend=attention_backend,
        disable_cuda_graph=disable_cuda_graph or eager_graph_buckets is not None, cuda_graph_bs=cuda_graph_bs,
        force_overlap_schedule=overlap is True, disable_overlap_schedule=overlap is False,
        enable_deterministic_inference=deterministic, enable_prefix_caching=prefix_caching,
        constrained_json_disable_any_whitespace=not json_any_whitespace,
        tp_size=parallel.tp_size if parallel is not None else 1, ep_size=parallel.ep_size if parallel else 1,
    )
    engine = Engine(cfg, model=model, model_config=model_config, tokenizer=tokenizer, parallel=parallel)
    if eager_graph_buckets is not None:
        engine.graph_runner = DecodeGraphRunner(engine.model, engine.kv.backend, engine.device, eager_graph_buckets,
                                                engine.context_length)
    if optimistic:
        sched = engine.scheduler
        sched.new_token_ratio = sched.min_new_token_ratio = sched.new_request_ratio = 0.0
    return engine


def random_prompt(gen: torch.Generator, length: int, vocab: int = 1024) -> list[int]:
    return torch.randint(2, vocab, (length,), generator=gen).tolist()


def count_selected(engine: Engine, result: RunResult) -> None:
    """Wrap the backend's sparse_attention to count valid top-k entries of decode steps, per layer."""
    backend = engine.kv.backend
    original = backend.sparse_attention
    num_layers = int(engine.model_config.num_hidden_layers)
    result.selected_per_layer = [0] * num_layers

    def counting(layer_id, q, topk, scale):
        if backend._current().is_decode:
            result.selected_per_layer[layer_id] += int((topk >= 0).sum())
        return original(layer_id, q, topk, scale)

    backend.sparse_attention = counting


def record_schedule(engine: Engine, result: RunResult) -> None:
    original = engine.scheduler.schedule

    def recording() -> ScheduledBatch | None:
        batch = original()
        result.schedule.append(
            None if batch is None else
            ([r.rid for r in batch.requests], list(batch.prefix_lens), list(batch.extend_lens), batch.is_decode)
        )
        return batch

    engine.scheduler.schedule = recording


def replay_schedule(engine: Engine, recorded: list) -> None:
    """Make `engine` run exactly the recorded batches (same requests, same chunks, same order).

    Batch composition changes floating-point results (matmul blocking depends on the batch), so comparing a
    HiSparse run that retracts against dense is only meaningful with identical batches.
    """
    sched = engine.scheduler
    steps = iter(recorded)

    def replaying() -> ScheduledBatch | None:
        entry = next(steps)
        if entry is None:
            return None
        rids, prefix, extend, is_decode = entry
        reqs = [engine._requests[rid] for rid in rids]
        for req in reqs:
            if req.status is RequestStatus.WAITING:
                assert sched.try_admit(req), "the replaying engine must have room for the recorded batch"
        for req, p, e in zip(reqs, prefix, extend, strict=True):
            # KV grows page by page; the replaying engine (dense, ample budget) never retracts.
            assert engine.kv.ensure_room(req.row, p + e + int(is_decode)), "the replaying engine ran out of KV"
        return ScheduledBatch(reqs, prefix, extend, is_decode)

    sched.schedule = replaying


def run_script(engine: Engine, arrivals: list[Arrival], max_steps: int = 10_000,
               replay: list | None = None) -> RunResult:
    result = RunResult()
    if engine.config.enable_hisparse:
        count_selected(engine, result)
    if replay is not None:
        replay_schedule(engine, replay)
    else:
        record_schedule(engine, result)

    def hook(rids: list[str], logits: torch.Tensor) -> None:
        for i, rid in enumerate(rids):
            result.logits.setdefault(rid, []).append(logits[i].detach().cpu().clone())

    engine.logits_hook = hook
    pending = sorted(arrivals, key=lambda a: a.step)
    aborts = {a.abort_at_step: a.rid for a in arrivals if a.abort_at_step is not None}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            engine.add_request(a.rid, a.prompt, SamplingParams(max_tokens=a.max_tokens, temperature=0.0))
            result.tokens[a.rid] = []
        if step in aborts:
            engine.abort_request(aborts[step])
        for d in engine.step():
            result.tokens[d.rid].extend(d.new_token_ids)
            if d.finished:
                result.finish[d.rid] = d.finish_reason
        step += 1
        if step > max_steps:
            raise AssertionError("workload did not finish")
    return result


def assert_identical(dense: RunResult, sparse: RunResult) -> None:
    assert dense.tokens == sparse.tokens
    assert dense.finish == sparse.finish
    assert dense.logits.keys() == sparse.logits.keys()
    for rid in dense.logits:
        assert len(dense.logits[rid]) == len(sparse.logits[rid])
        for i, (a, b) in enumerate(zip(dense.logits[rid], sparse.logits[rid], strict=True)):
            assert torch.equal(a, b), f"{rid}: logits of token {i} differ"


def assert_same_run(what: str, a: RunResult, b: RunResult) -> None:
    """`assert_identical` with a label, and no NaN in the logits (HiSparse pools are NaN-poisoned in the GPU tests:
    a row read before it was written shows there)."""
    assert a.tokens == b.tokens, f"{what}: tokens differ"
    assert a.finish == b.finish, f"{what}: finish reasons differ"
    for rid, logits in a.logits.items():
        assert len(logits) == len(b.logits[rid])
        for i, (x, y) in enumerate(zip(logits, b.logits[rid], strict=True)):
            assert not x.isnan().any(), f"{what}: {rid} token {i}: NaN in the logits"
            assert torch.equal(x, y), f"{what}: {rid} logits of token {i} differ by {float((x - y).abs().max()):.3e}"


def buffer_sized_workload(top_k: int, seed: int) -> list[Arrival]:
    """Ten requests for engines whose buffer holds top_k slots (D = top_k): prompts shorter and longer than the
    buffer (fast path, ring hits and misses), arrivals two a step so the batch size changes."""
    gen = torch.Generator().manual_seed(seed)
    return [Arrival(i // 2, f"r{i}", random_prompt(gen, top_k // 2 + 37 * i if i % 3 else top_k + 50 + 11 * i),
                    18 + (5 * i) % 13) for i in range(10)]


def run_poisoned_modes(tiny, arrivals: list[Arrival], modes: list[tuple[str, dict]], graphs: bool,
                       **common) -> tuple[dict[str, RunResult], dict[str, Engine]]:
    """One engine per (name, make_engine keywords) over the same arrivals; the first mode is dense and records the
    schedule, which every HiSparse mode replays. HiSparse pools are NaN-poisoned (0xFF is NaN in every row format:
    a row read before its copy landed shows in the logits). `graphs`: each engine must have captured its graphs."""
    results: dict[str, RunResult] = {}
    engines: dict[str, Engine] = {}
    for name, keywords in modes:
        engine = make_engine(tiny, **keywords, **common)
        if graphs:
            assert engine.graph_runner is not None, f"{name}: graphs were not captured: {engine.cuda_graph_error}"
        hisparse = engine.config.enable_hisparse
        if hisparse:
            engine.kv.host.kv.fill_(0xFF)
            engine.kv.buffers.kv.fill_(0xFF)
        first = next(iter(results.values()), None)
        if hisparse and first is None:
            raise ValueError("the first mode must be dense: it records the schedule the others replay")
        results[name] = run_script(engine, arrivals, replay=first.schedule if hisparse else None)
        engines[name] = engine
    return results, engines


# Engines whose device buffer holds 64 slots (tiny-dsa's and tiny-glm5's index_topk: D = top_k) in a small budget.
SMALL_BUFFER_ENGINE = {"buffer_size": 64, "num_recent": 2, "device_budget": 32 << 20}


def long_prompt_workload(seed: int, long_lengths: tuple[int, int, int]) -> list[Arrival]:
    """For SMALL_BUFFER_ENGINE: three prompts longer than the buffer decode on the long path and miss in every
    layer; a short one stays on the fast path in the same batches; the last arrives at step 3 and changes the
    batch."""
    gen = torch.Generator().manual_seed(seed)
    first, second, late = long_lengths
    return [Arrival(0, "a", random_prompt(gen, first), 12), Arrival(0, "b", random_prompt(gen, second), 10),
            Arrival(0, "c", random_prompt(gen, 30), 8), Arrival(3, "d", random_prompt(gen, late), 9)]


def swap_counters(engine: Engine) -> list[tuple[int, int]]:
    """Per layer (hits, misses) of a HiSparse engine's swap-ins so far."""
    return [(s.hits, s.misses) for s in engine.kv.layer_stats()]


def record_decode_order(engine: Engine) -> tuple[list[tuple[str, int, int | None]], list[tuple[int, ...]]]:
    """Wraps a HiSparse engine's backend so that each own swap-in ("swap"), speculative bet ("bet") and decode
    attention ("attention") appends (what, layer, the attention layer running when it happened or None) to the
    first list, and each end_forward appends what is still pending after it (prefetched layers, then bets) to the
    second."""
    backend = engine.kv.backend
    events: list[tuple[str, int, int | None]] = []
    attending: list[int] = []

    def wrap(kind: str, layer: int, swap):
        def recording(top_k, seq_lens, req_rows):
            events.append((kind, layer, attending[-1] if attending else None))
            return swap(top_k, seq_lens, req_rows)
        return recording

    backend.swaps[:] = [wrap("swap", layer, swap) for layer, swap in enumerate(backend.swaps)]
    backend.prefetch.speculative_swaps = [None if swap is None else wrap("bet", layer, swap)
                                          for layer, swap in enumerate(backend.prefetch.speculative_swaps)]
    decode_attention = backend._decode_attention

    def recording_attention(layer_id, q, topk, scale):
        events.append(("attention", layer_id, None))
        attending.append(layer_id)
        try:
            return decode_attention(layer_id, q, topk, scale)
        finally:
            attending.pop()

    backend._decode_attention = recording_attention
    pending_after: list[tuple[int, ...]] = []
    end_forward = backend.end_forward

    def checking_end(batch):
        end_forward(batch)
        pending_after.append(backend.prefetch.pending_layers + backend.prefetch.pending_bets)

    backend.end_forward = checking_end
    return events, pending_after


def assert_failed_attention_leaves_nothing_pending(engine: Engine, layer: int, message: str) -> None:
    """One request's first decode step fails in the attention of `layer` (raising `message`), after checking that
    exactly that layer's swap-in is pending on the side stream; end_forward must still join it (nothing pending)
    and close the forward (no batch left). Prefill steps do not call the decode attention."""
    backend = engine.kv.backend
    decode_attention = backend._decode_attention

    def failing(layer_id, q, topk, scale):
        if layer_id == layer:
            assert backend.prefetch.pending_layers == (layer,)
            raise RuntimeError(message)
        return decode_attention(layer_id, q, topk, scale)

    gen = torch.Generator().manual_seed(2)
    engine.add_request("x", random_prompt(gen, 100), SamplingParams(max_tokens=4, temperature=0.0))
    backend._decode_attention = failing
    with pytest.raises(RuntimeError, match=message):
        for _ in range(4):
            engine.step()
    assert backend.prefetch.pending_layers == ()
    assert backend._batch is None


def torch_sync_sources(step) -> list[str]:
    """Where each synchronizing torch operation of `step()` came from (file:line of the Python caller), recorded with
    CUDA's sync debug mode. The mode is switched on outside the recording: the first switch in a process warns about
    itself."""
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchronizing" in str(w.message)]
