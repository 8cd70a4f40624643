"""Overlap scheduling (engine.py `step()`): with the host one pass ahead of the device, every request's tokens,
logprobs, text and finish reasons equal those of the synchronous loop, dense and HiSparse, greedy and seeded, with
stop tokens, stop strings, max_tokens, multi-chunk prompts, retractions and aborts; every pool ends empty.

Overlap changes which passes a request shares (a request that ended runs one more pass, whose token is dropped;
memory comes back a pass later), and batch composition changes float rounding, so the comparisons run in
batch-invariant mode (`enable_deterministic_inference`), where a request's results do not depend on its batch.
On CPU the overlap path is forced on (`force_overlap_schedule`): its default is off there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from harness import PAGE, make_engine, random_prompt
from test_lossless import tight_hisparse_budget

from decode_server.config import EngineConfig
from decode_server.engine.engine import Engine, resolve_overlap_schedule
from decode_server.engine.sampling_params import SamplingParams

DENSE_ROW = 3 * (576 * 4 + 132)  # device bytes per token of tiny-dsa in float32 (MLA row + indexer key)


@dataclass
class Job:
    step: int
    rid: str
    prompt: list[int]
    params: SamplingParams
    abort_at: int | None = None


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[tuple] = field(default_factory=list)
    finish: tuple | None = None


def drive(engine: Engine, jobs: list[Job], max_steps: int = 3000, parallel: Any = None) -> dict[str, Outcome]:
    """Feed jobs at their steps, abort at theirs, and collect every delta; the engine must end idle and empty.
    `parallel` (a DP-attention rank's state): every rank steps until every rank is done (an all-reduce of 'still
    busy' per iteration, as the runtime's loop keeps DP ranks stepping)."""
    out: dict[str, Outcome] = {}
    pending = sorted(jobs, key=lambda j: j.step)
    aborts: dict[int, list[str]] = {}
    for j in jobs:
        if j.abort_at is not None:
            aborts.setdefault(j.abort_at, []).append(j.rid)
    step = 0
    while _anyone_busy(bool(pending) or engine.has_unfinished_requests(), parallel):
        while pending and pending[0].step <= step:
            j = pending.pop(0)
            engine.add_request(j.rid, j.prompt, j.params)
            out[j.rid] = Outcome()
        for rid in aborts.get(step, []):
            engine.abort_request(rid)
        for d in engine.step():
            o = out[d.rid]
            assert o.finish is None, f"{d.rid}: delta after its finish"
            o.tokens += d.new_token_ids
            o.text += d.text
            o.logprobs += [(lp.token_id, lp.logprob, tuple(lp.top_logprobs)) for lp in d.logprobs or []]
            if d.finished:
                o.finish = (d.finish_reason, d.stop_reason)
        step += 1
        assert step < max_steps, "workload did not finish"
    assert engine.is_idle_and_empty(), "a pool or a request row was not given back"
    return out


def _anyone_busy(busy: bool, parallel: Any) -> bool:
    if parallel is None:
        return busy
    import torch.distributed as dist

    flag = torch.tensor([int(busy)])
    dist.all_reduce(flag, group=parallel.cpu_group)
    return bool(flag.item())


def mixed_jobs(seed: int, num: int = 6) -> list[Job]:
    """Greedy, seeded sampling and logprobs; prompts of one to three 64-token prefill chunks; staggered arrivals."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(num):
        kind = i % 3
        sampling = ({"temperature": 0.0} if kind == 0 else
                    {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if kind == 1 else
                    {"temperature": 0.0, "logprobs": 2})  # fmt: skip
        params = SamplingParams(max_tokens=rng.randrange(3, 13), ignore_eos=True, **sampling)
        jobs.append(Job(rng.randrange(0, 6), f"j{i}", random_prompt(gen, rng.randrange(8, 140)), params))
    return jobs


def with_stops(jobs: list[Job], reference: dict[str, Outcome]) -> list[Job]:
    """Stop tokens and stop strings taken from a run without them, so that requests end mid-way on them."""
    out = []
    for i, j in enumerate(jobs):
        ref = reference[j.rid]
        update: dict = {}
        if i % 2 == 0 and len(ref.tokens) > 2:
            update["stop_token_ids"] = [ref.tokens[len(ref.tokens) // 2]]
        elif i % 4 == 1 and len(ref.text.strip()) > 4:
            mid = len(ref.text) // 2
            update["stop"] = [ref.text[mid : mid + 2]]
        out.append(Job(j.step, j.rid, j.prompt, j.params.model_copy(update=update), j.abort_at))
    return out


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_overlap_equals_sync(tiny_cpu, hisparse: bool) -> None:
    def engine(overlap: bool) -> Engine:
        e = make_engine(tiny_cpu, hisparse=hisparse, overlap=overlap, deterministic=True)
        assert e.overlap is overlap
        return e

    jobs = mixed_jobs(seed=3)
    reference = drive(engine(False), jobs)
    jobs = with_stops(jobs, reference)
    sync = drive(engine(False), jobs)
    overlapped_engine = engine(True)
    overlapped = drive(overlapped_engine, jobs)
    assert overlapped == sync
    reasons = [o.finish[0] for o in sync.values()]
    assert "stop" in reasons and "length" in reasons, reasons
    assert any(isinstance(o.finish[1], str) for o in sync.values()), "no request ended on a stop string"
    assert any(o.logprobs for o in sync.values())
    # Requests that ended on a stop had already been launched into the next pass: those tokens were dropped.
    assert overlapped_engine.num_discarded_tokens > 0


def retraction_jobs(seed: int, num: int = 10) -> list[Job]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    jobs = []
    for i in range(num):
        step = rng.randrange(0, 20)
        abort = step + rng.randrange(1, 12) if rng.random() < 0.3 else None
        sampling = {"temperature": 0.8, "seed": i} if i % 2 else {"temperature": 0.0}
        params = SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True, **sampling)
        jobs.append(Job(step, f"q{i}", random_prompt(gen, rng.randrange(5, 110)), params, abort))
    return jobs


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_overlap_with_retractions_and_aborts(tiny_cpu, hisparse: bool) -> None:
    """Tight budgets force retractions (a retracted request may have a token in flight); aborts land while a
    pass is in flight. Requests that were not aborted equal the synchronous run; an aborted request's tokens are
    a prefix of what the synchronous run gave it (the abort may land a pass earlier in its stream)."""
    budget = (dict(device_budget=tight_hisparse_budget(3, 10), host_budget=64 << 20) if hisparse
              else dict(device_budget=12 * PAGE * DENSE_ROW))  # fmt: skip

    def engine(overlap: bool) -> Engine:
        return make_engine(tiny_cpu, hisparse=hisparse, overlap=overlap, deterministic=True, optimistic=True,
                           max_running=5, chunk=96, **budget)

    jobs = retraction_jobs(seed=9)
    sync = drive(engine(False), jobs)
    overlapped_engine = engine(True)
    overlapped = drive(overlapped_engine, jobs)
    assert overlapped_engine.stats().num_retractions > 0, "the budget was meant to force retractions"
    aborted = {j.rid for j in jobs if j.abort_at is not None}
    for j in jobs:
        got, want = overlapped[j.rid], sync[j.rid]
        if j.rid not in aborted or want.finish[0] != "abort" and got.finish[0] != "abort":
            assert got == want, j.rid
        else:
            assert got.tokens == want.tokens[: len(got.tokens)], j.rid
            assert got.finish[0] in ("abort", want.finish[0])
    assert any(overlapped[r].finish[0] == "abort" for r in aborted)


def test_overlap_defers_frees_until_the_pass_is_done(tiny_cpu) -> None:
    """A request that ends on a stop token while the next pass (which includes it) is in flight keeps its row and
    pages until that pass is processed, then gives them back."""
    engine = make_engine(tiny_cpu, hisparse=True, overlap=True)
    prompt = random_prompt(torch.Generator().manual_seed(5), 30)
    probe = make_engine(tiny_cpu, hisparse=True, overlap=False)
    ref = drive(probe, [Job(0, "p", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))])
    stop = ref["p"].tokens[2]
    engine.add_request("p", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                                   stop_token_ids=[stop]))
    finished_at = None
    for i in range(20):
        deltas = engine.step()
        if any(d.finished for d in deltas):
            finished_at = i
            assert engine.stats().host_pages.used > 0, "freed while a launched pass still used the request"
            assert engine.has_unfinished_requests()
            break
    assert finished_at is not None
    assert engine.num_discarded_tokens == 0
    assert engine.step() == []
    assert engine.num_discarded_tokens == 1
    assert engine.is_idle_and_empty()


def test_overlap_defaults() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_overlap_schedule(EngineConfig(), cpu) is False  # nothing to overlap with on CPU
    assert resolve_overlap_schedule(EngineConfig(), cuda) is True
    assert resolve_overlap_schedule(EngineConfig(force_overlap_schedule=True), cpu) is True
    assert resolve_overlap_schedule(EngineConfig(disable_overlap_schedule=True), cuda) is False
    assert resolve_overlap_schedule(EngineConfig(tp_size=2, ep_size=2), cuda) is True  # TP ranks overlap too
    dp = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True}
    assert resolve_overlap_schedule(EngineConfig(**dp), cuda) is True  # and DP-attention ranks
    with pytest.raises(ValueError, match="contradict"):
        EngineConfig(force_overlap_schedule=True, disable_overlap_schedule=True)
