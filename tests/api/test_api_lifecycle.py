"""Process lifecycle on real servers: queue bound (503 + Retry-After), SIGTERM with requests in flight (clean
exit 0, no orphan), engine death (503, non-zero exit, no hang), start-up failure (clear error, exit 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
from api_server_harness import REPO, ServerProcess, assert_clean_exit, assert_no_orphans

MODEL = "tiny-dsa"
LONG = {
    "model": MODEL,
    "prompt": "Go on:",
    "max_tokens": 240,  # near the context length: still running when the test stops the server
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end in the background, keeping every payload."""

    def __init__(self, server: ServerProcess, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.status: int | None = None
        self.payloads: list[str] = []
        self.first = threading.Event()

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.server.url + "/v1/completions", json=self.body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.payloads.append(line[len("data: ") :])
                        self.first.set()
        except httpx.HTTPError as exc:
            self.payloads.append(f"<transport error {type(exc).__name__}>")
        finally:
            self.first.set()


def _wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_queue_bound_then_sigterm_with_requests_in_flight() -> None:
    server = ServerProcess("--max-running-requests", "1", "--max-queued-requests", "1").wait_ready()
    try:
        readers = [StreamReader(server, LONG) for _ in range(2)]
        for r in readers:
            r.start()
        _wait_for(lambda: (s := server.stats())["num_running_reqs"] == 1 and s["num_queue_reqs"] == 1)
        # one running + one waiting = the bound: the next request is refused, not queued without limit
        r = httpx.post(server.url + "/v1/completions", json=dict(LONG, stream=False), timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_overloaded"
        assert r.json()["error"]["code"] == 503

        _wait_for(lambda: any(r.payloads for r in readers))  # the running one streams, the other waits
        code = server.stop(signal.SIGTERM)
        for reader in readers:
            reader.join(30)
            assert not reader.is_alive()
            assert reader.status == 200
            assert reader.payloads[-1] == "[DONE]", reader.payloads[-3:]
            last = json.loads(reader.payloads[-2])
            assert "error" in last, reader.payloads[-3:]
            assert (
                last["error"]["type"] == "server_shutting_down"
                and "shutting down" in last["error"]["message"]
            )
        assert_clean_exit(server, code)
        assert "SIGTERM received" in server.log_text()
    finally:
        server.kill()


def test_engine_death_answers_503_and_exits_nonzero() -> None:
    server = ServerProcess().wait_ready()
    try:
        reader = StreamReader(server, LONG)
        reader.start()
        assert reader.first.wait(30)
        blocking: dict = {}

        def non_streaming() -> None:
            r = httpx.post(server.url + "/v1/completions", json=dict(LONG, stream=False), timeout=60)
            blocking.update(status=r.status_code, body=r.json())

        t = threading.Thread(target=non_streaming, daemon=True)
        t.start()
        _wait_for(lambda: server.stats()["num_running_reqs"] == 2)

        assert server.engine_pid is not None
        os.kill(server.engine_pid, signal.SIGKILL)

        reader.join(30)
        assert reader.payloads[-1] == "[DONE]"
        assert json.loads(reader.payloads[-2])["error"]["type"] == "engine_unavailable"
        t.join(30)
        assert blocking["status"] == 503 and blocking["body"]["error"]["type"] == "engine_unavailable"
        try:
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert r.status_code == 503  # if the server has not exited yet, it refuses clearly
        except httpx.TransportError:
            pass  # already gone: also not hanging
        code = server.proc.wait(30)
        assert code != 0
        assert "engine process" in server.log_text() and "died" in server.log_text()
        assert_no_orphans(server)
    finally:
        server.kill()


def test_startup_failure_is_a_clear_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "decode_server.cli", "serve", "--model-path", "/nonexistent/model", "--port", "0",
         "--device", "cpu"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "could not start" in proc.stderr and "/nonexistent/model" in proc.stderr
