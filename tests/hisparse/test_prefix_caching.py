"""Prefix caching in the engine (`--enable-prefix-caching`), dense and HiSparse, on CPU.

- HiSparse == dense bit for bit with caching on (both make the same caching decisions), pools NaN-poisoned.
- With `--enable-deterministic-inference` a request's tokens, logprobs and text are the same with or without the
  cache — through concurrent sharing, evictions, retractions, aborts and overlap scheduling — because a reused
  prefix ends on a chunk boundary (`PrefixSharing.align`) and batch-invariant kernels compute every later chunk as
  without the cache.
- Without deterministic mode a cached prefix changes where the prompt's chunks are cut, hence float rounding:
  logits stay within float32 noise of the uncached run.
- Accounting: requests that end leave only the cache's unlocked pages; a flush leaves every pool at zero.
"""

from __future__ import annotations

import random

import pytest
import torch
from harness import PAGE, Arrival, assert_identical, make_engine, random_prompt, run_script
from test_lossless import tight_hisparse_budget
from test_overlap import DENSE_ROW, Job, drive

from decode_server.engine.engine import Engine
from decode_server.engine.sampling_params import SamplingParams


def shared_prefix_arrivals(seed: int) -> list[Arrival]:
    """A system prompt longer than the device buffer (D = 64) shared by concurrent and later requests, one prompt
    repeated whole, one that shares only its first page, one that shares nothing."""
    gen = torch.Generator().manual_seed(seed)
    system = random_prompt(gen, 150)
    other = random_prompt(gen, 90)
    spec = [
        (0, system + random_prompt(gen, 30), 6),
        (1, system + random_prompt(gen, 12), 9),  # admitted while the first prefills: no hit yet
        (6, system + random_prompt(gen, 40), 5),  # the first's prompt pages are shared by now
        (6, other, 7),
        (30, system + random_prompt(gen, 25), 6),
        (30, other, 4),  # the whole prompt again: all but its last page reused
        (32, system[:20] + random_prompt(gen, 60), 5),  # one page of 16 shared
    ]
    return [Arrival(step, f"r{i}", prompt, m) for i, (step, prompt, m) in enumerate(spec)]


def first_prefill_positions(result) -> dict[str, int]:
    first: dict[str, int] = {}
    for entry in result.schedule:
        if entry is not None and not entry[3]:
            for rid, prefix in zip(entry[0], entry[1], strict=True):
                first.setdefault(rid, prefix)
    return first


def test_hisparse_matches_dense_with_prefix_caching(tiny_cpu):
    arrivals = shared_prefix_arrivals(seed=0)
    dense_engine = make_engine(tiny_cpu, hisparse=False, prefix_caching=True)
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, prefix_caching=True)
    engine.kv.host.kv.fill_(0xFF)  # a cached row read before it was written would show as NaN
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    stats, dense_stats = engine.stats().prefix_cache, dense_engine.stats().prefix_cache
    assert stats is not None and stats == dense_stats
    # Where each request's prefill started: after its cached prefix (r1 came while r0 was still prefilling).
    assert first_prefill_positions(sparse) == {"r0": 0, "r1": 0, "r2": 144, "r3": 0, "r4": 144, "r5": 80, "r6": PAGE}
    assert stats.hit_tokens == 2 * 144 + 80 + PAGE
    assert engine.stats().hisparse_misses > 0
    for e in (engine, dense_engine):
        assert e.is_idle_and_empty()
        cached = e.stats().prefix_cache.cached_tokens
        assert cached > 0 and e.flush_prefix_cache() == cached
        assert all(pool.used == 0 for pool in e.kv.usage().values()), e.kv.usage()


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_cached_equals_uncached_in_deterministic_mode(tiny_cpu, hisparse: bool):
    arrivals = shared_prefix_arrivals(seed=1)
    plain = run_script(make_engine(tiny_cpu, hisparse=False, deterministic=True), arrivals)
    engine = make_engine(tiny_cpu, hisparse=hisparse, deterministic=True, prefix_caching=True)
    cached = run_script(engine, arrivals)
    assert_identical(plain, cached)
    stats = engine.stats().prefix_cache
    assert stats.hit_tokens > 0 and stats.hit_tokens % 64 == 0, "reused prefixes end on chunk boundaries (64)"
    assert engine.is_idle_and_empty()


def test_without_deterministic_mode_cached_logits_are_float_noise_away(tiny_cpu):
    """Chunks cut after the cached prefix round differently from the uncached run's chunks: not the same bits,
    but the same computation."""
    arrivals = shared_prefix_arrivals(seed=2)
    plain = run_script(make_engine(tiny_cpu, hisparse=True), arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, prefix_caching=True)
    cached = run_script(engine, arrivals)
    assert engine.stats().prefix_cache.hit_tokens > 0
    first = {rid: logits[0] for rid, logits in plain.logits.items()}
    for rid, logits in cached.logits.items():
        torch.testing.assert_close(logits[0], first[rid], rtol=0, atol=1e-4)


def shared_prefix_jobs(seed: int, num: int = 14) -> list[Job]:
    """Staggered requests over three system prompts (greedy, seeded sampling, logprobs), some aborted."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    systems = [random_prompt(gen, n) for n in (70, 130, 200)]
    jobs = []
    for i in range(num):
        step = rng.randrange(0, 40)
        abort = step + rng.randrange(1, 10) if rng.random() < 0.25 else None
        sampling = ({"temperature": 0.0} if i % 3 == 0 else {"temperature": 0.8, "seed": i} if i % 3 == 1
                    else {"temperature": 0.0, "logprobs": 2})  # fmt: skip
        params = SamplingParams(max_tokens=rng.randrange(1, 12), ignore_eos=True, **sampling)
        prompt = rng.choice(systems) + random_prompt(gen, rng.randrange(1, 40))
        jobs.append(Job(step, f"q{i}", prompt, params, abort))
    return jobs


def compare_runs(jobs: list[Job], got: dict, want: dict) -> None:
    """Requests that were not aborted give the same results; an aborted one's tokens are a prefix of the other
    run's (the abort may land a pass earlier or later there)."""
    for j in jobs:
        a, b = got[j.rid], want[j.rid]
        if j.abort_at is None or (a.finish[0] != "abort" and b.finish[0] != "abort"):
            assert a == b, j.rid
        else:
            shorter, longer = sorted((a.tokens, b.tokens), key=len)
            assert longer[: len(shorter)] == shorter, j.rid


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_evictions_retractions_and_aborts_keep_results(tiny_cpu, hisparse: bool, overlap: bool):
    """Budgets so tight that the cache must give pages back and running requests are retracted (with borrowed
    prefixes); aborts land mid-prefill and mid-decode. Deterministic mode: results equal the uncached run with
    ample memory; every pool ends with the cache's pages only, and empty after a flush."""
    budget = (dict(device_budget=tight_hisparse_budget(4, 16), host_budget=64 << 20) if hisparse
              else dict(device_budget=16 * PAGE * DENSE_ROW))  # fmt: skip

    def engine(cache: bool, **kw) -> Engine:
        return make_engine(tiny_cpu, hisparse=hisparse, overlap=overlap, deterministic=True, optimistic=cache,
                           max_running=6, prefix_caching=cache, **kw)

    jobs = shared_prefix_jobs(seed=5)
    want = drive(engine(False), jobs)
    cached_engine = engine(True, **budget)
    got = drive(cached_engine, jobs)
    compare_runs(jobs, got, want)
    stats = cached_engine.stats()
    assert stats.prefix_cache.hit_tokens > 0
    assert stats.prefix_cache.evicted_tokens > 0, "the budget was meant to force evictions"
    assert stats.num_retractions > 0, "the budget was meant to force retractions"
    assert any(o.finish[0] == "abort" for o in got.values())
    cached_engine.flush_prefix_cache()
    assert all(pool.used == 0 for pool in cached_engine.kv.usage().values())


def test_failed_request_frees_its_prefix_and_pages(tiny_cpu):
    """A request failed mid-prefill (as a PD transfer failure does) unlocks its cached prefix and gives back its
    pages; its complete pages are kept for later prompts."""
    engine = make_engine(tiny_cpu, hisparse=True, prefix_caching=True, chunk=32)
    gen = torch.Generator().manual_seed(4)
    system = random_prompt(gen, 100)
    drive(engine, [Job(0, "warm", system + [7], SamplingParams(max_tokens=2, temperature=0.0))])
    engine.add_request("f", system + random_prompt(gen, 70), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # admitted with 96 cached tokens, first chunk of its remaining 75 prefilled
    req = engine.get_request("f")
    assert req.num_cached_tokens == 96 and req.num_computed == 128
    engine.fail_request("f", "KVTransferError", "transfer failed")
    assert [d.error_class for d in engine.step()] == ["KVTransferError"]
    assert engine.is_idle_and_empty()
    assert engine.stats().prefix_cache.cached_tokens == 128  # 96 + its own complete page (positions 96..111)
    engine.flush_prefix_cache()
    assert all(pool.used == 0 for pool in engine.kv.usage().values())


def test_multi_turn_reuses_the_answers_kv(tiny_cpu):
    """A chat's next turn = the last prompt + its answer + new text: the answer's decoded rows are reused too (only
    rows whose KV was computed: the answer's last token never was). HiSparse (pools NaN-poisoned) == dense."""
    gen = torch.Generator().manual_seed(6)
    first = random_prompt(gen, 100)
    follow_up = random_prompt(gen, 20)
    params = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, logprobs=2)

    def chat(engine: Engine) -> tuple[dict, dict, int]:
        turn1 = drive(engine, [Job(0, "t1", first, params)])
        # 100 + 28 tokens known, 127 computed: 7 whole pages are reusable, not the 8th (its last row is missing).
        turn2 = drive(engine, [Job(0, "t2", first + turn1["t1"].tokens + follow_up, params)])
        return turn1, turn2, engine.stats().prefix_cache.hit_tokens

    dense = chat(make_engine(tiny_cpu, hisparse=False, prefix_caching=True))
    engine = make_engine(tiny_cpu, hisparse=True, prefix_caching=True)
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = chat(engine)
    assert sparse == dense
    assert sparse[2] == 7 * PAGE
    uncached = drive(make_engine(tiny_cpu, hisparse=False),
                     [Job(0, "t2", first + dense[0]["t1"].tokens + follow_up, params)])
    for (_, want, _), (_, got, _) in zip(uncached["t2"].logprobs, sparse[1]["t2"].logprobs, strict=True):
        assert abs(want - got) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_prefix_caching_on_cuda(tiny_cuda, kv_cache_dtype: str):
    """On the GPU with its defaults (CUDA graphs, overlap scheduling, the real swap-in and backup kernels):
    HiSparse == dense with caching on, the host pool NaN-poisoned; and in deterministic mode cached == uncached."""
    arrivals = shared_prefix_arrivals(seed=0)
    dense_engine = make_engine(tiny_cuda, hisparse=False, device="cuda", prefix_caching=True,
                               kv_cache_dtype=kv_cache_dtype)
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(tiny_cuda, hisparse=True, device="cuda", prefix_caching=True, kv_cache_dtype=kv_cache_dtype)
    assert engine.overlap and engine.graph_runner is not None
    engine.kv.host.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert engine.stats().prefix_cache == dense_engine.stats().prefix_cache
    assert engine.stats().prefix_cache.hit_tokens == 2 * 144 + 80 + PAGE
    assert engine.stats().hisparse_misses > 0
    assert engine.is_idle_and_empty()
    plain = run_script(make_engine(tiny_cuda, hisparse=False, device="cuda", deterministic=True,
                                   kv_cache_dtype=kv_cache_dtype), arrivals)
    cached_engine = make_engine(tiny_cuda, hisparse=True, device="cuda", deterministic=True, prefix_caching=True,
                                kv_cache_dtype=kv_cache_dtype)
    assert_identical(plain, run_script(cached_engine, arrivals))
    assert cached_engine.stats().prefix_cache.hit_tokens > 0


@pytest.mark.parametrize("hisparse", [False, True], ids=["dense", "hisparse"])
def test_an_admission_that_fails_for_memory_counts_nothing_and_holds_nothing(tiny_cpu, hisparse: bool):
    """The scheduler tries a waiting request again later: a failed `try_admit` must give its cached prefix back
    and leave the hit counters alone (they count each admitted prompt once)."""
    engine = make_engine(tiny_cpu, hisparse=hisparse, prefix_caching=True)
    gen = torch.Generator().manual_seed(8)
    system = random_prompt(gen, 100)
    drive(engine, [Job(0, "warm", system + [5], SamplingParams(max_tokens=1, temperature=0.0))])
    kv, before = engine.kv, engine.stats().prefix_cache
    too_long = system + random_prompt(gen, kv.max_request_tokens)  # more pages than the pools have
    assert not kv.try_admit(0, len(too_long), len(too_long) + 1, too_long)
    assert engine.stats().prefix_cache == before and engine.is_idle_and_empty()
    fits = system + [6, 7]
    assert kv.try_admit(0, len(fits), len(fits) + 1, fits)
    after = engine.stats().prefix_cache
    assert (after.queried_tokens - before.queried_tokens, after.hit_tokens - before.hit_tokens) == (len(fits), 96)
    kv.free(0)
    assert engine.is_idle_and_empty()
