"""Routing policies: round_robin alternates over the healthy workers of each role; least_load sends new work to
the decode worker with fewer running requests (read from its GET /load); --api-key guards the router."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from router_harness import MODEL, RouterProcess, Worker, wait_all_idle

SHORT = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
LONG_STREAM = {"model": MODEL, "prompt": "Load:", "max_tokens": 200, "ignore_eos": True, "temperature": 0,
               "stream": True}  # fmt: skip


def _stopped(router: RouterProcess) -> None:
    try:
        assert router.stop(signal.SIGTERM) == 0, router.log_text()
    finally:
        router.kill()


def _counts(router: RouterProcess, ws: list[Worker]) -> list[float]:
    return [router.requests_at(w) for w in ws]


def _wait_counts(router: RouterProcess, ws: list[Worker], expected: list[float], timeout: float = 30) -> None:
    """Prefill's answer is drained in the background: its count lands a moment after the client's answer."""
    deadline = time.monotonic() + timeout
    while _counts(router, ws) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _counts(router, ws) == expected


def test_round_robin_alternates(router: RouterProcess, workers: tuple) -> None:
    """Round robin is per router process: the requests go over one connection (`router.http`), so to one
    process, and alternate there."""
    prefill, decode = workers
    p0 = _counts(router, prefill)
    last = _counts(router, decode)
    chosen = []
    for _ in range(4):
        assert router.http.post("/v1/completions", json=SHORT).status_code == 200
        now = _counts(router, decode)
        diff = [b - a for a, b in zip(last, now, strict=True)]
        assert sorted(diff) == [0, 1], diff  # exactly one decode worker answered
        chosen.append(diff.index(1))
        last = now
    assert chosen in ([0, 1, 0, 1], [1, 0, 1, 0]), chosen
    _wait_counts(router, prefill, [c + 2 for c in p0])  # prefill alternates too


@pytest.fixture(scope="module")
def least_load_router(workers: tuple) -> Iterator[RouterProcess]:
    prefill, decode = workers
    r = RouterProcess(prefill, decode, "--policy", "least_load", "--load-check-interval-secs", "0.2").wait_ready()
    try:
        yield r
    finally:
        _stopped(r)


def test_least_load_prefers_the_lighter_decode_worker(least_load_router: RouterProcess, workers: tuple) -> None:
    prefill, decode = workers
    heavy, light = decode
    wait_all_idle(prefill + decode)
    # Load `heavy` through a router that only knows it (so the same works with PD workers).
    loader = RouterProcess(prefill[:1], [heavy]).wait_ready()
    stop = threading.Event()

    def stream() -> None:
        with httpx.stream("POST", loader.url + "/v1/completions", json=LONG_STREAM, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            info = least_load_router.health().json()["workers"]["decode"]
            if info[0].get("load", {}).get("num_running_reqs", 0) >= 3:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the router never saw the load of {heavy.url}: {info}")
        before = _counts(least_load_router, decode)
        for _ in range(3):  # to the process whose /health saw the load (each process polls /load itself)
            assert least_load_router.http.post("/v1/completions", json=SHORT).status_code == 200
        after = _counts(least_load_router, decode)
        assert [b - a for a, b in zip(before, after, strict=True)] == [0, 3]
        assert least_load_router.metric("hisparse_router:worker_load", role="decode", worker=heavy.url) >= 3
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        _stopped(loader)
    wait_all_idle(prefill + decode)


def test_api_key_required_by_the_router(workers: tuple) -> None:
    prefill, decode = workers
    r = RouterProcess(prefill, decode, "--api-key", "router-key").wait_ready()
    try:
        missing = httpx.post(r.url + "/v1/completions", json=SHORT, timeout=30)
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        wrong = httpx.post(r.url + "/v1/completions", json=SHORT, headers={"Authorization": "Bearer x"}, timeout=30)
        assert wrong.status_code == 401
        ok = httpx.post(r.url + "/v1/completions", json=SHORT, headers={"Authorization": "Bearer router-key"},
                        timeout=60)  # fmt: skip
        assert ok.status_code == 200, ok.text
        assert httpx.get(r.url + "/health", timeout=10).status_code == 200  # probes need no key
    finally:
        _stopped(r)


def test_cache_aware_keeps_each_prompt_start_on_one_prefill_worker(workers: tuple) -> None:
    """Two system prompts, three questions each, alternating: each system prompt's requests all go to one prefill
    worker (its prefix cache would hold that start), the two to different workers; decode takes turns."""
    prefill, decode = workers
    wait_all_idle(prefill + decode)
    r = RouterProcess(prefill, decode, "--policy", "cache_aware").wait_ready()
    try:
        systems = ["You are a careful assistant who answers in French. " * 5,
                   "You are a terse assistant who answers in haiku only. " * 5]
        before = _counts(r, prefill)
        decode_before = _counts(r, decode)
        for i in range(3):
            for system in systems:
                body = {"model": MODEL, "prompt": system + f"Question {i}?", "max_tokens": 2, "temperature": 0}
                assert r.http.post("/v1/completions", json=body).status_code == 200
        _wait_counts(r, prefill, [c + 3 for c in before])  # 3 and 3: one system prompt each
        assert [b - a for a, b in zip(decode_before, _counts(r, decode), strict=True)] == [3, 3]
        assert r.metric("hisparse_router:cache_aware_decisions_total", outcome="hit") == 4
        assert r.metric("hisparse_router:cache_aware_decisions_total", outcome="miss") == 2
    finally:
        _stopped(r)
    wait_all_idle(prefill + decode)
