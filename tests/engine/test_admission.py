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
