"""Priority scheduling (--enable-priority-scheduling): waiting requests are admitted in order of their priority
(larger first, or smaller first with --schedule-low-priority-values-first), then of arrival; a later arrival of
higher priority goes ahead of those already waiting; retraction takes the lowest priority first; without the flag a
priority is ignored, or refused with --abort-on-priority-when-disabled. Outputs do not depend on the order (greedy tokens equal those of the same requests alone)."""

from __future__ import annotations

import pytest

from decode_server.engine.sampling_params import SamplingParams
from decode_server.errors import InvalidRequestError

ROW = 3 * (576 * 4 + 132)  # dense bytes per token of tiny-dsa in float32
PRIORITIES = {"a": 0, "b": 0, "c": 5, "d": -1, "e": 5}


def _params(priority: int, max_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)


def _first_token_order(engine, tokens: dict[str, list[int]] | None = None) -> list[str]:
    order: list[str] = []
    tokens = {} if tokens is None else tokens
    for _ in range(500):
        if not engine.has_unfinished_requests():
            return order
        for d in engine.step():
            if d.new_token_ids and d.rid not in order:
                order.append(d.rid)
            tokens.setdefault(d.rid, []).extend(d.new_token_ids)
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize(("low_first", "expected"), [(False, list("ceabd")), (True, list("dabce"))])
def test_waiting_requests_go_by_priority_then_arrival(make_engine, low_first: bool, expected: list[str]) -> None:
    engine = make_engine(max_running_requests=1, enable_priority_scheduling=True,
                         schedule_low_priority_values_first=low_first)  # fmt: skip
    for i, (rid, priority) in enumerate(PRIORITIES.items()):
        engine.add_request(rid, [3 + i] * 20, _params(priority))
    tokens: dict[str, list[int]] = {}
    assert _first_token_order(engine, tokens) == expected
    assert engine.is_idle_and_empty()
    # the order changed nothing of the outputs
    plain = make_engine(max_running_requests=1)
    for i, rid in enumerate(PRIORITIES):
        plain.add_request(rid, [3 + i] * 20, _params(0))
    plain_tokens: dict[str, list[int]] = {}
    assert _first_token_order(plain, plain_tokens) == list(PRIORITIES)  # arrival order
    assert tokens == plain_tokens


def test_a_later_arrival_of_higher_priority_goes_ahead(make_engine) -> None:
    engine = make_engine(max_running_requests=1, enable_priority_scheduling=True)
    engine.add_request("first", [5] * 20, _params(0, max_tokens=6))
    engine.step()  # "first" is admitted and runs
    engine.add_request("waiting", [6] * 20, _params(0))
    engine.add_request("urgent", [7] * 20, _params(9))
    assert _first_token_order(engine) == ["first", "urgent", "waiting"]


@pytest.mark.parametrize("hisparse", [False, True])
def test_retraction_takes_the_lowest_priority_first(make_engine, hisparse: bool) -> None:
    """64 pages of 2 tokens and six growing requests (tests/engine/test_admission.py): five are admitted (r5, of the
    lowest priority, waits), memory runs out and running requests are retracted; the first retracted is the oldest,
    r0, because it has the lowest priority of those running (without priorities the newest goes first)."""
    if hisparse:
        engine = make_engine(enable_hisparse=True, page_size=2, host_kv_budget_bytes=64 * 2 * 576 * 4 * 3,
                             enable_priority_scheduling=True)  # fmt: skip
    else:
        engine = make_engine(page_size=2, device_kv_budget_bytes=64 * 2 * ROW, enable_priority_scheduling=True)
    for i in range(6):
        engine.add_request(f"r{i}", [2 + i] * 2, _params((1, 5, 6, 7, 8, 0)[i], max_tokens=30))
    first_retracted = None
    tokens: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for d in engine.step():
            tokens.setdefault(d.rid, []).extend(d.new_token_ids)
        if first_retracted is None and engine.scheduler.retracted:
            first_retracted = engine.scheduler.retracted[0].rid
    assert first_retracted == "r0", first_retracted
    assert all(len(tokens[f"r{i}"]) == 30 for i in range(6)) and engine.is_idle_and_empty()


def test_without_the_flag_a_priority_is_ignored_or_refused(make_engine) -> None:
    engine = make_engine(max_running_requests=1)
    engine.add_request("low", [5] * 10, _params(0))
    engine.add_request("high", [6] * 10, _params(9))
    assert _first_token_order(engine) == ["low", "high"]  # arrival order
    strict = make_engine(abort_on_priority_when_disabled=True)
    with pytest.raises(InvalidRequestError, match="--enable-priority-scheduling") as exc:
        strict.add_request("p", [5] * 10, _params(3))
    assert exc.value.param == "priority"
    strict.add_request("zero", [5] * 10, _params(0))  # the default is no priority
    _first_token_order(strict)
    assert strict.is_idle_and_empty()
