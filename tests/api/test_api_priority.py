"""`priority` through real servers: a server started with --enable-priority-scheduling (one request at a time)
serves a later request of higher priority before an earlier one of lower priority, on the OpenAI and the native
route; the shared server, without the flag, ignores a priority (as SGLang does); one started with
--abort-on-priority-when-disabled refuses it with a 400 naming it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from api_server_harness import ServerProcess


@pytest.fixture(scope="module")
def prioritized():
    server = ServerProcess("--enable-priority-scheduling", "--max-running-requests", "1").wait_ready()
    try:
        yield server
    finally:
        server.kill()


async def _finish_order(url: str) -> list[str]:
    """A long request runs (its first token seen); then a low-priority and a high-priority one arrive, in that
    order, and wait for it (one request at a time)."""
    done: list[str] = []
    async with httpx.AsyncClient(timeout=120) as client:
        async def post(name: str, path: str, body: dict) -> None:
            r = await client.post(url + path, json=body)
            assert r.status_code == 200, r.text
            done.append(name)

        running = asyncio.Event()

        async def long() -> None:
            body = {"prompt": "Long", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        running.set()
            done.append("long")

        long_task = asyncio.create_task(long())
        await asyncio.wait_for(running.wait(), 60)
        low = asyncio.create_task(post("low", "/v1/completions", {"prompt": "Low", "max_tokens": 4, "priority": 0}))
        await asyncio.sleep(0.2)  # the low one is queued first
        high = asyncio.create_task(post("high", "/generate", {"text": "High", "priority": 5,
                                                              "sampling_params": {"max_new_tokens": 4}}))
        await asyncio.gather(long_task, low, high)
    return done


def test_a_later_request_of_higher_priority_is_served_first(prioritized: ServerProcess) -> None:
    started = time.monotonic()
    assert asyncio.run(_finish_order(prioritized.url)) == ["long", "high", "low"]
    assert time.monotonic() - started < 60


BODIES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "priority": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "priority": -1}),
    ("/generate", {"text": "x", "priority": 2, "sampling_params": {"max_new_tokens": 2}}),
]


def test_without_the_flag_a_priority_is_ignored_or_refused(dense_server: ServerProcess) -> None:
    for path, body in BODIES:
        r = httpx.post(dense_server.url + path, json=body, headers=dense_server.headers, timeout=60)
        assert r.status_code == 200, r.text
    strict = ServerProcess("--abort-on-priority-when-disabled").wait_ready()
    try:
        for path, body in BODIES:
            r = httpx.post(strict.url + path, json=body, timeout=60)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "priority" and "--enable-priority-scheduling" in error["message"]
    finally:
        strict.kill()
