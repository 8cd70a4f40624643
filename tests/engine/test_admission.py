"""Admission: requests that can never fit fail at once with a clear error; requests beyond the budget wait."""

from __future__ import annotations

import pytest

from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import (
    CapacityError,
    ContextLengthExceededError,
    InvalidRequestError,
    QueueFullError,
)

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
ROW = 3 * (576 * 4 + 132)  # dense bytes per token of tiny-dsa in float32


def drain(engine, max_steps: int = 500) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return out
        for d in engine.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("hisparse", [False, True])
def test_request_that_can_never_fit_fails_fast(make_engine, hisparse):
    if hisparse:
        engine = make_engine(enable_hisparse=True, host_kv_budget_bytes=4 * 16 * 576 * 4 * 3)  # 4 host pages
    else:
        engine = make_engine(device_kv_budget_bytes=8 * 16 * ROW)  # 8 pages of 16 tokens
    with pytest.raises(CapacityError, match="never fit"):
        engine.add_request("big", list(range(2, 200)), GREEDY)
    assert not engine.has_unfinished_requests()
    engine.add_request("small", list(range(2, 30)), GREEDY)
    assert len(drain(engine)["small"]) == 4
    assert engine.is_idle_and_empty()


def test_context_length_and_invalid_requests(make_engine):
    engine = make_engine(context_length=64)
    assert engine.context_length == 64
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("a", list(range(2, 62)), SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("b", [], GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.add_request("c", [5, 100_000], GREEDY)
    engine.add_request("d", [5, 6], GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("d", [5, 6], GREEDY)


def test_requests_beyond_the_budget_wait(make_engine):
    # 10 pages of 16 tokens; each request reserves 40 + 8 - 1 = 47 tokens = 3 pages: three run at once.
    engine = make_engine(device_kv_budget_bytes=10 * 16 * ROW)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for i in range(5):
        engine.add_request(f"r{i}", [2 + i] * 40, params)
    most_running = 0
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for d in engine.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
        stats = engine.stats()
        most_running = max(most_running, stats.num_running_reqs)
        assert stats.num_running_reqs <= 3
        assert stats.dense_kv_slots.used <= stats.dense_kv_slots.total
    assert most_running == 3
    assert all(len(out[f"r{i}"]) == 8 for i in range(5))
    assert engine.is_idle_and_empty()


def test_queue_bound(make_engine):
    engine = make_engine(max_queued_requests=2)
    engine.add_request("a", [3, 4], GREEDY)
    engine.add_request("b", [3, 4], GREEDY)
    with pytest.raises(QueueFullError):
        engine.add_request("c", [3, 4], GREEDY)


def test_abort_frees_waiting_and_running_requests(make_engine):
    engine = make_engine(enable_hisparse=True)
    engine.add_request("run", list(range(2, 90)), SamplingParams(max_tokens=50, temperature=0.0))
    engine.add_request("wait", list(range(2, 20)), GREEDY)
    engine.step()
    engine.step()
    engine.abort_request("run")
    engine.abort_request("wait")
    deltas = engine.step()
    assert {d.rid: d.finish_reason for d in deltas} == {"run": "abort", "wait": "abort"}
    assert not engine.has_unfinished_requests()
    assert engine.is_idle_and_empty()
    engine.abort_request("unknown")  # no error


def run_tracking(engine, max_steps: int = 5000, out: dict | None = None) -> tuple[dict[str, list[int]], int]:
    """Run to the end; returns each request's tokens and the most requests that ran at once."""
    out = {} if out is None else out
    most = 0
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return out, most
        for d in engine.step():
            out.setdefault(d.rid, []).extend(d.new_token_ids)
        most = max(most, engine.stats().num_running_reqs + engine.stats().num_retracted_reqs)
    if max_steps < 5000:
        return out, most
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("hisparse", [False, True])
def test_admission_estimates_growth_instead_of_reserving_the_worst_case(make_engine, hisparse):
    """64 pages of 2 tokens; six requests that may each grow to 16 pages: reserving the worst case runs 4 at once,
    the new-token-ratio estimate admits 5; all finish with every token (retracted and resumed if they must)."""
    if hisparse:
        engine = make_engine(enable_hisparse=True, page_size=2, host_kv_budget_bytes=64 * 2 * 576 * 4 * 3)
        assert engine.kv.layout.host_pages == 64 and engine.kv.layout.indexer_pages >= 64
    else:
        engine = make_engine(page_size=2, device_kv_budget_bytes=64 * 2 * ROW)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [2 + i] * 2, params)
    out, most = run_tracking(engine)
    assert most == 5
    assert all(len(out[f"r{i}"]) == 30 for i in range(6))
    assert engine.is_idle_and_empty()


def test_max_request_tokens_is_the_smaller_of_context_and_cache(make_engine):
    assert make_engine(device_kv_budget_bytes=8 * 16 * ROW, context_length=256).max_request_tokens == 128
    assert make_engine(context_length=200).max_request_tokens == 200


@pytest.mark.parametrize("hisparse", [False, True])
def test_short_request_is_not_blocked_by_a_large_one_that_does_not_fit(make_engine, hisparse):
    """10 pages: a long request runs; another long one cannot fit yet; a short one behind it is admitted now."""
    if hisparse:
        engine = make_engine(enable_hisparse=True, host_kv_budget_bytes=10 * 16 * 576 * 4 * 3)
    else:
        engine = make_engine(device_kv_budget_bytes=10 * 16 * ROW)
    long_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    engine.add_request("long0", list(range(2, 102)), long_params)
    run_tracking(engine, 1, out)
    engine.add_request("long1", list(range(3, 103)), long_params)
    engine.add_request("short", [5, 6, 7], GREEDY)
    run_tracking(engine, 1, out)
    status = {r.rid: r.status.value for r in engine._requests.values()}
    assert status["long1"] == "waiting"
    assert status["short"] in ("prefilling", "running")
    run_tracking(engine, out=out)
    assert len(out["long1"]) == 40 and len(out["short"]) == 4
    assert engine.is_idle_and_empty()


def test_a_blocked_request_is_not_starved_by_later_short_ones(make_engine, monkeypatch):
    import decode_server.engine.scheduler as scheduler

    monkeypatch.setattr(scheduler, "HOL_BYPASS_LIMIT", 2)
    engine = make_engine(device_kv_budget_bytes=11 * 16 * ROW)
    long_params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    out: dict[str, list[int]] = {}
    engine.add_request("long0", list(range(2, 102)), long_params)
    run_tracking(engine, 1, out)
    engine.add_request("long1", list(range(3, 103)), long_params)
    for i in range(4):
        engine.add_request(f"s{i}", [5 + i, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    run_tracking(engine, 1, out)
    waiting = [r.rid for r in engine.scheduler.waiting]
    assert waiting == ["long1", "s2", "s3"], "two short requests may pass long1, then the queue waits for it"
    run_tracking(engine, out=out)
    assert all(len(v) in (40, 4) for v in out.values()) and len(out) == 6
    assert engine.is_idle_and_empty()
