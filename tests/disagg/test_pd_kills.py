"""PD peers dying mid-transfer (real processes, real mooncake over TCP): the survivor fails the request with a
clear error and frees every page, staging row and room. The prefill server computes small chunks so that the
transfer of a long prompt is still going when its peer is killed."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import openai
import pytest
from pd_harness import MODEL, PrefillServer, decode_server, disagg_stats, start_all, wait_for, wait_pd_idle

LONG_PROMPT = [(11 * i) % 800 + 5 for i in range(240)]  # 30 chunks of 8 tokens on the prefill server
_rooms = itertools.count(50_000)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict]:
    prefill = PrefillServer("--chunked-prefill-size", "8")
    victim_decode = decode_server(hisparse=False)
    decode = decode_server(hisparse=True)
    everyone = [prefill, victim_decode, decode]
    start_all(*everyone)
    try:
        yield {"prefill": prefill, "victim_decode": victim_decode, "decode": decode}
    finally:
        for s in everyone:
            s.kill()


async def _send(server, body: dict):
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120) as c:
        return await c.completions.create(**body)


def _body(prefill: PrefillServer) -> dict:
    return {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0,
            "extra_body": {"ignore_eos": True, **prefill.route(next(_rooms))}}


def test_decode_killed_prefill_frees(servers):
    prefill, victim = servers["prefill"], servers["victim_decode"]
    body = _body(prefill)

    async def run():
        p = asyncio.create_task(_send(prefill, body))
        d = asyncio.create_task(_send(victim, body))
        await asyncio.to_thread(wait_for, lambda: disagg_stats(prefill)["rooms_by_state"].get("TRANSFERRING") == 1,
                                60, "prefill's room transferring")
        victim.kill()
        results = await asyncio.gather(p, d, return_exceptions=True)
        return results

    p_result, d_result = asyncio.run(run())
    assert isinstance(d_result, openai.APIConnectionError)  # its server is gone
    assert isinstance(p_result, openai.APIStatusError), p_result
    assert p_result.status_code == 503 and "KV transfer to decode failed" in p_result.message
    d = wait_pd_idle(prefill)
    assert d["failures_by_cause"].get("transfer", 0) == 1


def test_prefill_killed_mid_transfer(servers):
    prefill, decode = servers["prefill"], servers["decode"]
    body = _body(prefill)

    async def run():
        p = asyncio.create_task(_send(prefill, body))
        d = asyncio.create_task(_send(decode, body))
        await asyncio.to_thread(wait_for, lambda: disagg_stats(prefill)["rooms_by_state"].get("TRANSFERRING") == 1,
                                60, "prefill's room transferring")
        assert disagg_stats(decode)["rooms_by_state"] == {"WAITING": 1}
        prefill.kill()
        return await asyncio.gather(p, d, return_exceptions=True)

    _, d_result = asyncio.run(run())
    assert isinstance(d_result, openai.APIStatusError), d_result
    assert d_result.status_code == 503 and "lost connection with prefill" in d_result.message, d_result.message
    d = wait_pd_idle(decode)
    assert d["failures_by_cause"].get("heartbeat", 0) == 1
