"""The harness's free_port: below the ephemeral range, bindable, and never the same port twice in one process
(a fixture picks every port before its servers bind them)."""

from __future__ import annotations

import socket

import api_server_harness as harness
import pytest


def test_a_port_is_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    first = harness.free_port()
    low, _ = harness._ephemeral_range()
    assert first < low
    others = [p for p in range(low - 1, low - 60, -1) if p != first]
    draws = iter([first, first, *others])
    monkeypatch.setattr(harness._PORT_RNG, "randrange", lambda a, b: next(draws))
    second = harness.free_port()  # the same number drawn twice more, then others
    assert second != first and second in others
    with socket.socket() as s:
        s.bind(("127.0.0.1", second))  # nothing listens on it


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        fresh = harness.free_port()
        others = [p for p in range(fresh + 1, fresh + 60) if p != taken]
        draws = iter([taken, *others])
        monkeypatch.setattr(harness._PORT_RNG, "randrange", lambda a, b: next(draws))
        assert harness.free_port() in others
