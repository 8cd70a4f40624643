"""Logit bias, min_tokens and the repetition / frequency / presence penalties in the engine (dense and HiSparse).

Every sampled token is checked against a per-token reference written from the definitions (vLLM's order and
formulas, engine/logits_processor.py) applied to the model's own logits of that step, with the history the host
knows: greedy rows must pick the reference's argmax, seeded rows must draw what the sampler draws from the
reference's logits with the same generator, logprobs stay those of the model's logits. This holds through prefill
chunks, retractions (tight budgets), aborts, overlap scheduling and more penalized requests than the counts table
first holds; HiSparse == dense bit for bit with penalties; every ending frees the request's counts.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from harness import PAGE, make_engine, random_prompt, torch_sync_sources
from test_lossless import tight_hisparse_budget
from test_overlap import DENSE_ROW, Job

from decode_server.engine.engine import Engine
from decode_server.engine.sampler import make_generator, sample_row, token_seed
from decode_server.engine.sampling_params import SamplingParams

F32 = torch.float32


def reference_logits(raw: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                     eos: frozenset[int]) -> torch.Tensor:
    """The definitions, token by token, in float32 as the engine computes them."""
    x = raw.detach().cpu().float().clone()
    for token, bias in params.logit_bias.items():
        x[token] = x[token] + torch.tensor(bias, dtype=F32)
    if len(output) < params.min_tokens:
        for token in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)):
            x[token] = float("-inf")
    rep = torch.tensor(params.repetition_penalty, dtype=F32)
    if params.repetition_penalty != 1.0:
        for token in set(prompt) | set(output):
            x[token] = x[token] / rep if x[token] > 0 else x[token] * rep
    freq, presence = torch.tensor(params.frequency_penalty, dtype=F32), torch.tensor(params.presence_penalty, dtype=F32)
    for token, count in Counter(output).items():
        x[token] = x[token] - freq * torch.tensor(float(count), dtype=F32) - presence
    return x


def reference_pick(logits: torch.Tensor, params: SamplingParams, index: int, device: torch.device) -> int:
    """Output token `index` from the reference's logits: their argmax, or the sampler's draw with the generator the
    engine seeds for that token (it lives on the engine's device: drawn there)."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    generator = make_generator(token_seed(params.seed, index), device)
    return int(sample_row(logits.to(device), params, generator))


@dataclass
class Record:
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # the model's logits of each sampled token
    logprobs: list[float] = field(default_factory=list)
    finish: tuple | None = None
    text: str = ""


def drive(engine: Engine, jobs: list[Job], max_steps: int = 3000) -> dict[str, Record]:
    """Run the jobs; every delta and every sampled row's model logits are recorded; the engine must end empty."""
    out = {j.rid: Record() for j in jobs}

    def hook(rids: list[str], logits: torch.Tensor) -> None:
        for i, rid in enumerate(rids):
            out[rid].logits.append(logits[i].detach().cpu().clone())

    engine.logits_hook = hook
    pending = sorted(jobs, key=lambda j: j.step)
    aborts = {j.abort_at: j.rid for j in jobs if j.abort_at is not None}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].step <= step:
            j = pending.pop(0)
            engine.add_request(j.rid, j.prompt, j.params)
        if step in aborts:
            engine.abort_request(aborts[step])
        for d in engine.step():
            rec = out[d.rid]
            rec.tokens += d.new_token_ids
            rec.text += d.text
            rec.logprobs += [lp.logprob for lp in d.logprobs or []]
            if d.finished:
                rec.finish = (d.finish_reason, d.stop_reason)
        step += 1
        assert step < max_steps, "workload did not finish"
    assert engine.is_idle_and_empty(), "a pool, a request row or a request's counts were not given back"
    assert engine.logits_processor.slots_in_use == 0
    return out


def check_against_reference(engine: Engine, jobs: list[Job], got: dict[str, Record]) -> int:
    """Every token of every job is the one the reference picks; returns how many tokens the edits changed (a
    workload whose edits change nothing would prove nothing)."""
    changed = 0
    for j in jobs:
        rec = got[j.rid]
        assert rec.finish is not None, j.rid
        assert len(rec.logits) == len(rec.tokens), j.rid
        for i, (token, raw) in enumerate(zip(rec.tokens, rec.logits, strict=True)):
            want = reference_logits(raw, j.params, j.prompt, rec.tokens[:i], engine.eos_token_ids)
            pick = reference_pick(want, j.params, i, engine.device)
            assert token == pick, f"{j.rid}: token {i} is {token}, the reference picks {pick}"
            changed += int(pick != int(torch.argmax(raw.float()))) if j.params.is_greedy else 0
        if j.params.logprobs is not None:
            model = [float(torch.log_softmax(r.float(), -1)[t]) for t, r in zip(rec.tokens, rec.logits, strict=True)]
            assert rec.logprobs == pytest.approx(model, abs=1e-6), f"{j.rid}: logprobs are not the model's"
    return changed


def penalty_jobs(seed: int, num: int = 14, vocab: int = 1024) -> list[Job]:
    """Greedy and seeded requests over every edit and mixes of them, plus plain ones; a bias pulls a few favoured
    tokens up so that outputs repeat and the penalties have something to push against; some aborted."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    favoured = rng.sample(range(2, vocab), 6)
    kinds = [
        {},
        {"logit_bias": {t: 6.0 for t in favoured}},
        {"logit_bias": {t: 6.0 for t in favoured}, "frequency_penalty": 1.5},
        {"logit_bias": {t: 6.0 for t in favoured}, "presence_penalty": 2.0, "frequency_penalty": -0.3},
        {"logit_bias": {t: 6.0 for t in favoured}, "repetition_penalty": 1.9},
        {"repetition_penalty": 0.4, "logit_bias": {favoured[0]: -100.0}},
        {"min_tokens": 6, "logit_bias": {1: 100.0}},  # EOS (id 1) held back for 6 tokens, then taken
        {"min_tokens": 3, "stop_token_ids": [favoured[1]], "logit_bias": {favoured[1]: 100.0}},
    ]
    jobs = []
    for i in range(num):
        edits = kinds[i % len(kinds)]
        sampling = {"temperature": 0.0} if i % 3 else {"temperature": 0.9, "seed": 100 + i}
        if i % 4 == 1:
            sampling["logprobs"] = 1
        step = rng.randrange(0, 30)
        abort = step + rng.randrange(2, 12) if rng.random() < 0.2 else None
        params = SamplingParams(max_tokens=rng.randrange(8, 20), **sampling, **edits)
        jobs.append(Job(step, f"p{i}", random_prompt(gen, rng.randrange(20, 150)), params, abort))
    return jobs


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_every_token_is_the_references_through_retractions_and_aborts(tiny_cpu, hisparse: bool, overlap: bool):
    """Budgets so tight that running requests are retracted (their counts survive) while 14 requests, up to 8 of
    them penalized at once, come and go; some are aborted."""
    budget = (dict(device_budget=tight_hisparse_budget(4, 12), host_budget=64 << 20) if hisparse
              else dict(device_budget=24 * PAGE * DENSE_ROW))  # fmt: skip
    engine = make_engine(tiny_cpu, hisparse=hisparse, overlap=overlap, optimistic=True, max_running=10, **budget)
    jobs = penalty_jobs(seed=7)
    got = drive(engine, jobs)
    assert engine.stats().num_retractions > 0, "the budget was meant to force retractions"
    assert any(r.finish[0] == "abort" for r in got.values())
    changed = check_against_reference(engine, [j for j in jobs if got[j.rid].finish[0] != "abort"], got)
    assert changed >= 10, f"the edits changed only {changed} greedy tokens"


def test_hisparse_matches_dense_with_penalties(tiny_cpu):
    """Same tokens and the same model logits bit for bit in both modes with every edit in play."""
    jobs = penalty_jobs(seed=11)
    runs = {h: drive(make_engine(tiny_cpu, hisparse=h, max_running=16), jobs) for h in (False, True)}
    for j in jobs:
        dense, sparse = runs[False][j.rid], runs[True][j.rid]
        assert dense.tokens == sparse.tokens and dense.finish == sparse.finish, j.rid
        for a, b in zip(dense.logits, sparse.logits, strict=True):
            assert torch.equal(a, b), j.rid


def test_min_tokens_holds_back_eos_stop_ids_and_stop_strings(tiny_cpu):
    """A bias makes EOS / a stop token / a stop string the top choice at every step: each ends the request at
    once without min_tokens, and exactly at min_tokens with it (EOS and stop ids then come as token min_tokens)."""
    engine = make_engine(tiny_cpu, hisparse=True)
    stop_token = 77
    stop_text = engine.tokenizer.decode([stop_token])
    assert stop_text and stop_text.isprintable()
    prompt = random_prompt(torch.Generator().manual_seed(3), 40)
    cases = {
        "eos0": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={1: 100.0}),
        "eos5": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={1: 100.0}, min_tokens=5),
        "eos_ignored": SamplingParams(max_tokens=6, temperature=0.0, logit_bias={1: 100.0}, min_tokens=3,
                                      ignore_eos=True),
        "id0": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={stop_token: 100.0},
                              stop_token_ids=[stop_token]),
        "id4": SamplingParams(max_tokens=20, temperature=0.7, seed=1, logit_bias={stop_token: 100.0},
                              stop_token_ids=[stop_token], min_tokens=4),
        "str0": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={stop_token: 100.0}, stop=[stop_text]),
        "str3": SamplingParams(max_tokens=20, temperature=0.0, logit_bias={stop_token: 100.0}, stop=[stop_text],
                               min_tokens=3),
        "max": SamplingParams(max_tokens=4, temperature=0.0, logit_bias={1: 100.0}, min_tokens=4),
    }
    jobs = [Job(0, rid, prompt, p) for rid, p in cases.items()]
    got = drive(engine, jobs)
    check_against_reference(engine, jobs, got)
    assert got["eos0"].tokens == [1] and got["eos0"].finish == ("stop", None)
    assert len(got["eos5"].tokens) == 6 and got["eos5"].tokens[-1] == 1 and 1 not in got["eos5"].tokens[:-1]
    assert got["eos_ignored"].tokens == [1] * 6 and got["eos_ignored"].finish == ("length", None)
    assert got["id0"].tokens == [stop_token] and got["id0"].finish == ("stop", stop_token)
    assert len(got["id4"].tokens) == 5 and got["id4"].finish == ("stop", stop_token)
    assert stop_token not in got["id4"].tokens[:-1]
    # Stop strings are not masked: the token is generated, and only from min_tokens on does its text stop.
    assert got["str0"].tokens == [stop_token] and got["str0"].finish == ("stop", stop_text)
    assert got["str0"].text == ""
    assert got["str3"].tokens == [stop_token] * 3 and got["str3"].finish == ("stop", stop_text)
    assert got["str3"].text == stop_text * 2
    assert got["max"].finish == ("length", None) and 1 not in got["max"].tokens


def test_counts_are_freed_on_every_ending_and_reused(tiny_cpu):
    """Finished, aborted (waiting, prefilling, decoding) and failed requests give their counts back; later requests
    reuse the slots, and a table outgrown by 20 concurrent penalized requests keeps every count."""
    engine = make_engine(tiny_cpu, hisparse=True, max_running=32)
    proc = engine.logits_processor
    gen = torch.Generator().manual_seed(5)
    penalized = SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.5, logit_bias={9: 4.0})
    for i in range(4):
        engine.add_request(f"a{i}", random_prompt(gen, 30), penalized)
    for _ in range(3):
        engine.step()
    assert proc.slots_in_use == 4
    engine.abort_request("a0")
    assert engine.fail_request("a1", "TransferError", "the peer died")
    assert proc.slots_in_use == 2
    engine.add_request("waiting", random_prompt(gen, 30), penalized)
    engine.abort_request("waiting")  # never sampled: held nothing
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.is_idle_and_empty() and proc.slots_in_use == 0
    jobs = [Job(0, f"g{i}", random_prompt(gen, 20 + i), penalized) for i in range(20)]
    got = drive(engine, jobs)
    assert proc._counts is not None and proc._counts.shape[0] >= 20
    check_against_reference(engine, jobs, got)


def test_logit_bias_outside_the_vocabulary_is_refused(tiny_cpu):
    engine = make_engine(tiny_cpu, hisparse=False)
    with pytest.raises(Exception, match="outside the vocabulary"):
        engine.add_request("x", [5, 6, 7], SamplingParams(logit_bias={1024: 1.0}))
    assert engine.is_idle_and_empty()


@pytest.mark.gpu
@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_logits_processing_on_cuda(tiny_cuda, hisparse: bool):
    """On the GPU with CUDA graphs and overlap scheduling: every token is the reference's (computed on the CPU from
    the step's logits), with retractions, and HiSparse == dense holds (the second parametrization compares)."""
    bf16_row = 576 * 2  # tiny-dsa's MLA row in bf16
    budget = (dict(device_budget=tight_hisparse_budget(4, 12, row_bytes=bf16_row), host_budget=64 << 20) if hisparse
              else dict(device_budget=24 * PAGE * 3 * (bf16_row + 132)))  # fmt: skip
    engine = make_engine(tiny_cuda, hisparse=hisparse, device="cuda", optimistic=True, max_running=10, **budget)
    assert engine.overlap and engine.graph_runner is not None, engine.cuda_graph_error
    jobs = penalty_jobs(seed=7)
    got = drive(engine, jobs)
    finished = [j for j in jobs if got[j.rid].finish[0] != "abort"]
    assert check_against_reference(engine, finished, got) >= 10
    if hisparse:
        dense = drive(make_engine(tiny_cuda, hisparse=False, device="cuda", max_running=16),
                      [Job(j.step, j.rid, j.prompt, j.params) for j in jobs])
        plain = drive(make_engine(tiny_cuda, hisparse=True, device="cuda", max_running=16),
                      [Job(j.step, j.rid, j.prompt, j.params) for j in jobs])
        for j in jobs:
            assert dense[j.rid].tokens == plain[j.rid].tokens, j.rid
            for a, b in zip(dense[j.rid].logits, plain[j.rid].logits, strict=True):
                assert torch.equal(a, b), j.rid


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_penalized_decode_step_still_syncs_once(tiny_cuda, overlap: bool):
    """Every edit in play (counts built, advanced, bias, min_tokens, repetition over the prompt) adds no wait for
    the GPU: a decode step still synchronizes once (test_decode_syncs_gpu.py's two counts)."""
    from test_decode_syncs_gpu import _runtime_syncs

    engine = make_engine(tiny_cuda, hisparse=True, device="cuda", overlap=overlap)
    gen = torch.Generator().manual_seed(2)
    params = SamplingParams(max_tokens=60, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, logit_bias={5: 2.0, 9: -1.0}, min_tokens=40)
    for i in range(4):
        engine.add_request(f"r{i}", random_prompt(gen, 100 + 17 * i), params)
    while len(engine.scheduler.running) < 4:  # prefill (several chunks), then warm-up decode steps
        engine.step()
    for _ in range(3):
        engine.step()
    assert engine.logits_processor.slots_in_use == 4
    torch.cuda.synchronize()
    sources = [torch_sync_sources(engine.step) for _ in range(8)]
    counts = [len(s) for s in sources]
    assert (all(c <= 1 for c in counts) if overlap else counts == [1] * 8), f"syncs per step {counts}: {sources}"
    _runtime_syncs(lambda: None)
    baseline = _runtime_syncs(lambda: None)
    runtime = [_runtime_syncs(engine.step) - baseline for _ in range(3)]
    assert runtime == [1] * 3, f"synchronizing CUDA runtime calls per decode step: {runtime} (baseline {baseline})"
    for i in range(4):
        engine.abort_request(f"r{i}")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.is_idle_and_empty()
