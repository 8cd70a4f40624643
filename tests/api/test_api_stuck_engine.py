"""A stopped engine (SIGSTOP) is seen through its heartbeat: /health turns 503 within the heartbeat timeout,
/health_generate answers 503, the in-flight stream ends with a clear error, the engine is trusted again when it
resumes, and after `--watchdog-timeout` seconds of silence it is killed and the server exits non-zero. An engine
step running longer than the watchdog timeout ends the engine process from its heartbeat thread."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass

import httpx
import zmq
from api_server_harness import ServerProcess, assert_no_orphans

from decode_server.runtime.heartbeat import Heartbeat
from decode_server.runtime.messages import FatalMsg, HeartbeatMsg, decode_from_engine

HEARTBEAT_TIMEOUT = 1.5
WATCHDOG_TIMEOUT = 8.0


def wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate():
            return time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"{what} not within {timeout} s")


def health(server: ServerProcess) -> int:
    try:
        return httpx.get(server.url + "/health", timeout=5).status_code
    except httpx.HTTPError:
        return -1


def test_stopped_engine_is_detected_then_killed_by_the_watchdog() -> None:
    server = ServerProcess("--engine-heartbeat-timeout", str(HEARTBEAT_TIMEOUT),
                           "--watchdog-timeout", str(WATCHDOG_TIMEOUT)).wait_ready()  # fmt: skip
    try:
        frames: list[str] = []

        def stream() -> None:
            body = {"model": "tiny-dsa", "prompt": "once", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                frames.extend(line for line in r.iter_lines() if line.startswith("data:"))

        reader = threading.Thread(target=stream)
        reader.start()
        wait_for(lambda: len(frames) >= 2, 60, "first tokens")
        assert server.engine_pid is not None
        os.kill(server.engine_pid, signal.SIGSTOP)
        took = wait_for(lambda: health(server) == 503, HEARTBEAT_TIMEOUT + 3, "/health 503")
        assert took <= HEARTBEAT_TIMEOUT + 3
        body = httpx.get(server.url + "/health", timeout=5).json()
        assert body["error"]["type"] == "engine_unavailable" and "not responding" in body["error"]["message"]
        t0 = time.monotonic()
        r = httpx.get(server.url + "/health_generate", timeout=30)
        assert r.status_code == 503 and time.monotonic() - t0 < 5
        reader.join(30)
        assert not reader.is_alive()
        assert frames[-1] == "data: [DONE]" and "not responding" in frames[-2], frames[-3:]
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-dsa", "prompt": "x"}, timeout=10)
        assert r.status_code == 503 and r.headers.get("retry-after")

        # Resumed before the watchdog fires: trusted again, and it serves.
        os.kill(server.engine_pid, signal.SIGCONT)
        wait_for(lambda: health(server) == 200, 10, "/health 200 after SIGCONT")
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny-dsa", "prompt": "x", "max_tokens": 2},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text

        # Stopped for good: the watchdog kills it and the server exits with 1.
        os.kill(server.engine_pid, signal.SIGSTOP)
        code = server.proc.wait(WATCHDOG_TIMEOUT + 30)
        assert code == 1
        assert "killed by the watchdog" in server.log_text()
        assert_no_orphans(server)
    finally:
        if server.engine_pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.engine_pid, signal.SIGCONT)
        server.kill()


@dataclass
class _StuckLoop:
    num_loops: int = 7
    step_started: float | None = None


def _run_heartbeat(address: str, watchdog_timeout: float) -> None:
    loop = _StuckLoop(step_started=time.monotonic())  # a step that never ends
    Heartbeat(zmq.Context(), address, loop, watchdog_timeout).run()


def test_a_step_longer_than_the_watchdog_ends_the_engine_process() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/from_engine"
        ctx = zmq.Context()
        pull = ctx.socket(zmq.PULL)
        pull.bind(address)
        try:
            proc = multiprocessing.get_context("spawn").Process(target=_run_heartbeat, args=(address, 1.2))
            proc.start()
            proc.join(30)
            assert proc.exitcode == 3
            msgs = []
            while pull.poll(100):
                msgs.append(decode_from_engine(pull.recv()))
            beats = [m for m in msgs if isinstance(m, HeartbeatMsg)]
            assert beats and beats[0].num_loops == 7 and beats[-1].step_running_s > 0
            assert isinstance(msgs[-1], FatalMsg) and "watchdog" in msgs[-1].message
        finally:
            pull.close(linger=0)
            ctx.term()
