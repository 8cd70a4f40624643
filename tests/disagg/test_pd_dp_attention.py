"""PD with a data-parallel-attention decode server: a prefill server and a `--tp-size 2 --dp-size 2
--enable-dp-attention` HiSparse decode server as real processes, real mooncake over TCP on 127.0.0.1, the control
plane authenticated with a cluster secret (requests carry the router's ticket).

Each decode rank runs its own receiver and registers its own memory, so prefill writes a request's KV into the
rank that serves it and nowhere else: read from each rank's pool and transfer gauges while a request decodes.
Greedy tokens equal colocated serving's, with concurrent requests on both ranks."""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import HISPARSE_CONFIG, MODEL, PrefillServer, decode_server, start_all, wait_pd_idle
from prometheus_client.parser import text_string_to_metric_families

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams
from transfer.auth import PDAuth

CONTEXT_LENGTH = 256
PROMPTS = [[(7 * i + 3 * n) % 900 + 5 for i in range(n)] for n in (6, 70, 150, 90)]
_rooms = itertools.count(5_000)


@pytest.fixture(scope="module")
def secret(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pd-dp") / "secret"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def servers(secret: Path) -> Iterator[dict]:
    auth_args = ("--disaggregation-auth-secret-file", str(secret))
    prefill = PrefillServer(*auth_args)
    decode = decode_server("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", *auth_args, hisparse=True)
    start_all(prefill, decode)
    try:
        yield {"prefill": prefill, "decode": decode, "auth": PDAuth.from_file(secret)}
    finally:
        for server in (prefill, decode):
            server.kill()


def _fields(servers: dict, room: int) -> dict:
    prefill = servers["prefill"]
    fields = prefill.route(room)
    fields["bootstrap_auth"] = servers["auth"].sign_ticket("127.0.0.1", prefill.bootstrap_port, room)
    return fields


async def _pd_request(servers: dict, prompt: list[int], max_tokens: int):
    """What a router does: the same ticketed body to prefill and decode at once; decode's answer is the result."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True, **_fields(servers, next(_rooms))}}
    clients = [openai.AsyncOpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
               for s in (servers["prefill"], servers["decode"])]  # fmt: skip
    async with clients[0] as pc, clients[1] as dc:
        _, d = await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))
    return d


def _rank_gauges(server) -> dict[tuple[str, int], float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {(s.name, int(s.labels["dp_rank"])): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if "dp_rank" in s.labels}  # fmt: skip


def test_dp_decode_greedy_equals_colocated(servers):
    llm = LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH, enable_hisparse=True,
              hisparse={"device_buffer_size": 64, "num_recent_slots": 4})  # fmt: skip
    assert '"device_buffer_size": 64' in HISPARSE_CONFIG
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]

    async def all_at_once():
        return await asyncio.gather(*(_pd_request(servers, p, 5) for p in PROMPTS))

    outs = asyncio.run(all_at_once())
    assert [o.choices[0].text for o in outs] == expected
    decode = servers["decode"]
    d = wait_pd_idle(decode)
    assert d["rooms_finished"].get("SUCCESS", 0) >= len(PROMPTS) and not d["failures_by_cause"]
    assert d["auth"] and not d["rejected_by_reason"]
    ranks = decode.stats()["dp_ranks"]
    assert all(r["kv_transfer_bytes"] > 0 and r["num_generated_tokens"] > 0 for r in ranks), ranks
    wait_pd_idle(servers["prefill"])
    # Each rank registered its own memory with its own transfer engine: two destinations.
    engine = httpx.get(decode.url + "/server_info", timeout=10).json()["engine"]
    sessions = [r["disaggregation"]["session_id"] for r in engine["dp_ranks"]]
    endpoints = [r["disaggregation"]["control_endpoint"] for r in engine["dp_ranks"]]
    assert len(set(sessions)) == 2 and len(set(endpoints)) == 2 and all(endpoints)
    assert all(r["disaggregation"]["auth"] == "on" for r in engine["dp_ranks"])


def _start(servers: dict, prompt: list[int], max_tokens: int) -> tuple[threading.Thread, list]:
    result: list = []
    sender = threading.Thread(target=lambda: result.append(asyncio.run(_pd_request(servers, prompt, max_tokens))))
    sender.start()
    return sender, result


def _wait_running(decode, rank: int) -> dict:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        gauges = _rank_gauges(decode)
        if gauges[("hisparse:dp_num_running_reqs", rank)] >= 1:
            return gauges
        time.sleep(0.02)
    raise AssertionError(f"no request ran on rank {rank}")


def test_kv_lands_in_the_owning_rank_only(servers):
    """Request A alone goes to rank 0 (the api balances by requests in flight, ties to the lower rank), request B,
    sent while A decodes, to rank 1. While each decodes, its rank's host pool holds its KV and that rank's transfer
    counter alone grew by its bytes; the other rank's pool and counter are untouched by it."""
    decode = servers["decode"]
    wait_pd_idle(decode)
    transfer, pages = "hisparse:dp_kv_transfer_bytes_total", "hisparse:dp_host_pool_used_pages"
    start = _rank_gauges(decode)
    a, a_result = _start(servers, PROMPTS[1], 150)
    during_a = _wait_running(decode, 0)
    assert during_a[("hisparse:dp_num_running_reqs", 1)] == 0
    assert during_a[(pages, 0)] > 0 and during_a[(pages, 1)] == 0
    a_bytes = during_a[(transfer, 0)] - start[(transfer, 0)]
    assert a_bytes > 0 and during_a[(transfer, 1)] == start[(transfer, 1)]
    b, b_result = _start(servers, PROMPTS[0], 20)
    during_b = _wait_running(decode, 1)
    assert during_b[(pages, 1)] > 0
    b_bytes = during_b[(transfer, 1)] - start[(transfer, 1)]
    assert b_bytes > 0 and during_b[(transfer, 0)] == start[(transfer, 0)] + a_bytes  # rank 0 got nothing of B
    assert b_bytes < a_bytes  # B's prompt is shorter: its own bytes, not a copy of A's
    for sender in (a, b):
        sender.join(120)
    assert a_result[0].usage.completion_tokens == 150 and b_result[0].usage.completion_tokens == 20
    wait_pd_idle(decode)
