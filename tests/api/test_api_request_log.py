"""`--log-requests` through a real server: a line when a request arrives and one when it ends, with what each level
adds (level 2: the sampling parameters and the texts, cut short); the shared server, without the flag, logs none."""

from __future__ import annotations

import time

import httpx
from api_server_harness import ServerProcess

LONG_PROMPT = " compresses" * 200  # 2200 characters in 201 tokens: cut at 2048 in the log


def _lines(server: ServerProcess, marker: str, count: int) -> list[str]:
    deadline = time.monotonic() + 10
    while True:
        lines = [line for line in server.log_text().splitlines() if marker in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)


def test_requests_are_logged_at_level_2() -> None:
    server = ServerProcess("--log-requests", "--log-requests-level", "2").wait_ready()
    try:
        out = httpx.post(server.url + "/v1/completions", json={
            "prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "rid": "logged-1"},
            timeout=60).json()  # fmt: skip
        (received,) = _lines(server, "request received: rid=logged-1", 1)
        assert "route=/v1/completions" in received and "choices=1" in received and "prompt_tokens=[" in received
        assert "'max_tokens': 3" in received and "'ignore_eos': True" in received and "Hello there'" in received
        (finished,) = _lines(server, "request finished: rid=logged-1", 1)
        assert "finish_reasons=['length']" in finished and "completion_tokens=[3]" in finished
        assert repr(out["choices"][0]["text"]) in finished and "e2e_latency=" in finished
        httpx.post(server.url + "/generate", json={"text": LONG_PROMPT, "rid": "logged-2",
                                                   "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        (received,) = _lines(server, "request received: rid=logged-2", 1)
        assert "route=/generate" in received and "more characters)" in received and LONG_PROMPT not in received
        assert _lines(server, "request finished: rid=logged-2", 1)
    finally:
        server.kill()


def test_no_request_lines_without_the_flag(dense_server: ServerProcess) -> None:
    httpx.post(dense_server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
               headers=dense_server.headers, timeout=60)  # fmt: skip
    assert "request received:" not in dense_server.log_text()
