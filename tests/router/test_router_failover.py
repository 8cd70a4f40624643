"""Worker failure: a prefill worker killed mid-run leaves the rotation, requests in flight end (no hang), new
ones go to the other prefill worker; with no prefill worker left, a clear 503 at once."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time

import httpx
from router_harness import MODEL, RouterProcess, launch_workers, wait_all_idle

SHORT = {"model": MODEL, "prompt": "Hi there", "max_tokens": 4, "temperature": 0}
MEDIUM_STREAM = {"model": MODEL, "prompt": "Tell me:", "max_tokens": 24, "ignore_eos": True, "temperature": 0,
                 "stream": True}  # fmt: skip


def _stream(url: str, started: threading.Event) -> str:
    """The whole SSE text of one request (whatever its ending); `started` is set at its first token."""
    with httpx.stream("POST", url + "/v1/completions", json=MEDIUM_STREAM, timeout=300) as r:
        parts = [f"{r.status_code}\n"]
        for text in r.iter_text():
            parts.append(text)
            if '"text":"' in text:
                started.set()
        return "".join(parts)


def test_prefill_killed_mid_run(workers: tuple) -> None:
    prefill, decode = workers
    (victim,), _ = launch_workers(1, 0)
    # No periodic checks after the first: only the failing requests themselves can take the victim out.
    pair_router = RouterProcess([victim, prefill[0]], decode[:1], "--policy", "round_robin",
                                "--health-check-interval-secs", "3600").wait_ready()  # fmt: skip
    solo_router = RouterProcess([victim], decode[:1]).wait_ready()
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            events = [threading.Event() for _ in range(4)]
            in_flight = [pool.submit(_stream, pair_router.url, e) for e in events]
            for e in events:  # every stream is generating (two of them paired with the victim)
                assert e.wait(300)
            victim.server.proc.send_signal(signal.SIGKILL)
            victim.server.proc.wait(10)
            # Requests in flight end, one way or the other (finished or with an error event): no hang.
            for f in in_flight:
                text = f.result(timeout=300)
                assert text.startswith("200") and text.rstrip().endswith("data: [DONE]"), text
        # New requests: all answered through the surviving prefill worker (the timeouts bound every wait: no hang).
        # They go over one connection, so to one router process: the one that finds the victim dead.
        for _ in range(4):
            r = pair_router.http.post("/v1/completions", json=SHORT)
            assert r.status_code == 200, r.text
        health = pair_router.health().json()["workers"]["prefill"]
        assert [w["healthy"] for w in health] == [False, True], health
        assert pair_router.metric("hisparse_router:worker_healthy", role="prefill", worker=victim.url) == 0
        # The first request routed to the dead worker failed to connect and was retried on the other pair.
        assert pair_router.metric("hisparse_router:requests_total", role="prefill", worker=victim.url,
                                  outcome="unreachable") == 1  # fmt: skip
        assert pair_router.metric("hisparse_router:retries_total") == 1

        # The only prefill worker is gone: a clear OpenAI-style 503 at once, /health 503.
        started = time.monotonic()
        r = httpx.post(solo_router.url + "/v1/completions", json=SHORT, timeout=60)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "workers_unavailable" and "prefill" in error["message"], error
        assert r.headers.get("retry-after") == "1"
        assert time.monotonic() - started < 10
        # Every process finds out (from its own checks): /health is 503 whichever process answers.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if all(httpx.get(solo_router.url + "/health", timeout=10).status_code == 503 for _ in range(8)):
                break
            time.sleep(0.1)
        else:
            raise AssertionError("some router process still reports a healthy prefill worker")
        wait_all_idle([prefill[0], decode[0]])
    finally:
        for r in (pair_router, solo_router):
            try:
                assert r.stop() == 0, r.log_text()
            finally:
                r.kill()
        victim.server.kill()


def test_unresponsive_worker_leaves_and_rejoins_the_rotation(workers: tuple) -> None:
    """A decode worker that stops answering (SIGSTOP) fails its health checks and gets no requests; once it
    answers again (SIGCONT) it is back in rotation. Health and requests go over `r.http`: one router process."""
    prefill, decode = workers
    frozen, alive = decode
    r = RouterProcess(prefill[:1], decode, "--health-check-interval-secs", "0.3", "--health-check-timeout-secs",
                      "0.5", "--health-failure-threshold", "2", "--health-success-threshold", "2").wait_ready()  # fmt: skip

    def healthy() -> list[bool]:
        return [w["healthy"] for w in r.health().json()["workers"]["decode"]]

    def wait_for(state: list[bool]) -> None:
        deadline = time.monotonic() + 30
        while healthy() != state and time.monotonic() < deadline:
            time.sleep(0.1)
        assert healthy() == state

    try:
        frozen.server.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for([False, True])
            assert r.health().status_code == 200  # one decode worker is enough
            before = r.requests_at(alive)
            for _ in range(3):
                assert r.http.post("/v1/completions", json=SHORT).status_code == 200
            assert r.requests_at(alive) - before == 3
        finally:
            frozen.server.proc.send_signal(signal.SIGCONT)
        wait_for([True, True])
        before = r.requests_at(frozen)
        for _ in range(2):
            assert r.http.post("/v1/completions", json=SHORT).status_code == 200
        assert r.requests_at(frozen) - before == 1  # round robin again over both
    finally:
        try:
            assert r.stop() == 0, r.log_text()
        finally:
            r.kill()


def test_decode_silent_mid_stream_ends_with_an_error_event(workers: tuple) -> None:
    """Decode stops answering after the first bytes (SIGSTOP): the stream ends with an OpenAI-style error event
    and [DONE] after --request-timeout-secs (no retry: the client saw tokens); both workers free the request."""
    prefill, decode = workers
    r = RouterProcess(prefill[:1], decode[:1], "--request-timeout-secs", "5").wait_ready()
    body = {"model": MODEL, "prompt": "Go on:", "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    frames: list[str] = []
    try:
        with httpx.stream("POST", r.url + "/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(line)
                if len(frames) == 2:
                    decode[0].server.proc.send_signal(signal.SIGSTOP)
        decode[0].server.proc.send_signal(signal.SIGCONT)
        assert frames[-1] == "data: [DONE]"
        error = json.loads(frames[-2][len("data: "):])["error"]
        assert error["type"] == "worker_failed" and error["code"] == 502 and "timed out" in error["message"], error
        assert r.metric("hisparse_router:requests_total", role="decode", worker=decode[0].url,
                        outcome="stream_error") == 1  # fmt: skip
        wait_all_idle([prefill[0], decode[0]])
    finally:
        decode[0].server.proc.send_signal(signal.SIGCONT)
        try:
            assert r.stop() == 0, r.log_text()
        finally:
            r.kill()
