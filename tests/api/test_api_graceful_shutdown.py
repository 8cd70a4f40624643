"""SIGTERM with `--graceful-shutdown-timeout`: the server leaves rotation at once (/health and new requests answer
503) while the requests in flight run to completion, then it exits cleanly; a second signal aborts what is left."""

from __future__ import annotations

import signal
import threading
import time

import httpx
from openai import OpenAI

from tests.api.api_server_harness import ServerProcess, assert_clean_exit

MODEL = "tiny-dsa"
# Long enough to stay in flight while the test checks the draining server: the checks follow the signal within
# milliseconds (they poll, no fixed sleep), while 240 tokens of tiny-dsa take over a second even on an idle CI
# machine (~7 ms a token). A 48-token stream once finished, and the server exited, inside a fixed 0.3 s sleep.
IN_FLIGHT_TOKENS = 240


def _stream_in_thread(url: str, max_tokens: int, result: dict) -> threading.Thread:
    def run() -> None:
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="drain me", max_tokens=max_tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        reasons = []
        try:
            for chunk in stream:
                result.setdefault("first_chunk", time.monotonic())
                reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        except Exception as exc:  # the aborted stream ends with an error event
            result["error"] = repr(exc)
        result["reasons"] = reasons

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_first_chunk(result: dict) -> None:
    deadline = time.monotonic() + 60
    while "first_chunk" not in result and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "first_chunk" in result, "the stream never started"


def _wait_draining(server: ServerProcess) -> httpx.Response:
    """Poll /health right after the signal until it leaves rotation (503); returns that answer."""
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(server.url + "/health", timeout=5)
        if health.status_code != 200 or time.monotonic() > deadline:
            return health
        time.sleep(0.005)


def test_sigterm_drains_requests_in_flight() -> None:
    server = ServerProcess("--graceful-shutdown-timeout", "60").wait_ready()
    try:
        result: dict = {}
        thread = _stream_in_thread(server.url, IN_FLIGHT_TOKENS, result)
        _wait_first_chunk(result)
        server.proc.send_signal(signal.SIGTERM)
        health = _wait_draining(server)
        assert health.status_code == 503, health.text
        refused = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2},
                             timeout=10)  # fmt: skip
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_shutting_down"
        thread.join(120)
        assert result.get("reasons") == ["length"], result  # ran to completion, not aborted
        assert_clean_exit(server, server.proc.wait(60))
    finally:
        server.kill()


def test_second_signal_aborts_what_is_left() -> None:
    server = ServerProcess("--graceful-shutdown-timeout", "600").wait_ready()
    try:
        result: dict = {}
        thread = _stream_in_thread(server.url, IN_FLIGHT_TOKENS, result)
        _wait_first_chunk(result)
        server.proc.send_signal(signal.SIGTERM)
        assert _wait_draining(server).status_code == 503
        assert server.proc.poll() is None, "the server must wait for the stream (600 s drain)"
        t0 = time.monotonic()
        code = server.stop(signal.SIGTERM, timeout=30)
        assert time.monotonic() - t0 < 30
        thread.join(30)
        assert_clean_exit(server, code)
        assert result.get("reasons") != ["length"], "the second signal must abort the stream"
    finally:
        server.kill()
