"""PD with tensor-parallel servers: prefill servers with `--tp-size 1` and `2`, and `--tp-size 2` decode servers
(HiSparse, whose host pool the node's ranks share, and dense) as real processes, real mooncake over TCP on
127.0.0.1.

A TP decode server's rank 0 alone receives each prompt's KV, into memory both ranks map (the HiSparse host pool;
the staging areas); every rank installs it and commits the first token at the same point of its lockstep loop. A
TP prefill server's rank 0 alone sends, from its own cache; every rank admits the request when decode's
destination arrives and frees its KV when the room ends. Checked here: greedy tokens equal colocated serving's
with concurrent requests, for each pairing; both ranks of every server agree on steps, token digest and pools, PD
staging rows included; a transfer that fails and a client that leaves mid-transfer free every rank's memory, on
either side."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import (
    MODEL,
    PrefillServer,
    decode_server,
    disagg_stats,
    flush_cache,
    refused_completion,
    start_all,
    wait_for,
    wait_pd_idle,
)

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams
from decode_server.hisparse.shared_host import SHM_PREFIX

CONTEXT_LENGTH = 256
PROMPTS = [[(7 * i + 3 * n) % 900 + 5 for i in range(n)] for n in (6, 70, 150, 90)]
RANK_KEYS = ("num_steps", "num_generated_tokens", "token_digest", "host_pages_used", "device_slots_used",
             "indexer_slots_used", "dense_kv_slots_used", "pd_staging_rows_used")  # fmt: skip
MEMORY_KEYS = ("host_pages_used", "device_slots_used", "indexer_slots_used", "dense_kv_slots_used",
               "pd_staging_rows_used")  # fmt: skip
_rooms = itertools.count(7_000)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict]:
    # The TP prefill server caches prefixes (both ranks must decide alike: test_tp_prefill_reuses_a_cached_prefix).
    prefills = {"prefill_tp1": PrefillServer(),
                "prefill_tp2": PrefillServer("--tp-size", "2", "--enable-prefix-caching")}
    decodes = {"hisparse": decode_server("--tp-size", "2", hisparse=True),
               "dense": decode_server("--tp-size", "2", "--ep-size", "2", hisparse=False)}  # fmt: skip
    everyone = [*prefills.values(), *decodes.values()]
    start_all(*everyone)
    try:
        yield {"prefill": prefills["prefill_tp1"], **prefills, **decodes}
    finally:
        for server in everyone:
            server.kill()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


async def _pd_request(prefill, decode, prompt: list[int], max_tokens: int):
    """What a router does: the same body to prefill and decode at once; decode's answer is the result."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True, **prefill.route(next(_rooms))}}
    async with _client(prefill) as pc, _client(decode) as dc:
        _, d = await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))
    return d


def _ranks_agree(server) -> list[dict]:
    """Both ranks report rank 0's steps, token digest, pools and PD staging rows."""
    ranks = server.stats()["tp_ranks"]
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert {k: ranks[0][k] for k in RANK_KEYS} == {k: ranks[1][k] for k in RANK_KEYS}, ranks
    return ranks


def _wait_free_everywhere(server) -> list[dict]:
    """Nothing of PD in flight (rank 0's receiver) and every rank's pools and staging rows empty (a server with a
    prefix cache drops its pages first: only pages no request holds go)."""
    wait_pd_idle(server)
    if server.stats().get("prefix_cache") is not None:
        flush_cache(server)
    deadline = time.monotonic() + 10
    while True:
        ranks = _ranks_agree(server)
        if not any(r[k] for r in ranks for k in MEMORY_KEYS):
            return ranks
        assert time.monotonic() < deadline, ranks
        time.sleep(0.1)


def _rank_pids(server) -> list[int]:
    pids = httpx.get(server.url + "/server_info", timeout=10).json()["engine"]["tp_rank_pids"]
    assert len(pids) == 2
    return pids


def _shared_regions(pid: int) -> set[str]:
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(None, 5)[5] for line in lines if SHM_PREFIX in line}


@pytest.mark.parametrize("prefill_name", ["prefill_tp1", "prefill_tp2"])
@pytest.mark.parametrize("mode", ["hisparse", "dense"])
def test_tp_greedy_equals_colocated(servers, mode, prefill_name):
    kwargs = {"enable_hisparse": True, "hisparse": {"device_buffer_size": 64, "num_recent_slots": 4}} \
        if mode == "hisparse" else {}
    llm = LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH, **kwargs)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    expected = [o.text for o in llm.generate(PROMPTS, params)]
    prefill, decode = servers[prefill_name], servers[mode]

    async def all_at_once():
        return await asyncio.gather(*(_pd_request(prefill, decode, p, 6) for p in PROMPTS))

    outs = asyncio.run(all_at_once())
    assert [o.choices[0].text for o in outs] == expected
    assert all(o.usage.completion_tokens == 6 for o in outs)
    d = wait_pd_idle(decode)
    assert d["rooms_finished"].get("SUCCESS", 0) >= len(PROMPTS) and not d["failures_by_cause"]
    ranks = _wait_free_everywhere(decode)
    assert all(r["num_generated_tokens"] >= 5 * len(PROMPTS) for r in ranks)  # every rank decoded every request
    if prefill_name == "prefill_tp2":  # both prefill ranks computed every prompt and freed its held KV
        ranks = _wait_free_everywhere(prefill)
        assert all(r["num_generated_tokens"] >= len(PROMPTS) for r in ranks)
    else:
        wait_pd_idle(prefill)


def test_tp_prefill_reuses_a_cached_prefix(servers):
    """A TP prefill server with prefix caching: both ranks make the same caching decisions (their pools agree while
    pages are cached), rank 0 sends the cached prefix's rows with the first chunk, and decode's greedy text equals
    colocated serving's."""
    prefill, decode = servers["prefill_tp2"], servers["hisparse"]
    _wait_free_everywhere(prefill)
    shared = [(13 * i) % 900 + 5 for i in range(150)]
    prompts = [shared + [7, 8, 9], shared + [10, 11, 12, 13]]
    llm = LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH, enable_hisparse=True,
              hisparse={"device_buffer_size": 64, "num_recent_slots": 4})
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = []
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "extra_body": {"ignore_eos": True, **prefill.route(next(_rooms))}}

        async def both(body=body):
            async with _client(prefill) as pc, _client(decode) as dc:
                return await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))

        p, d = asyncio.run(both())
        cached.append(p.usage.prompt_tokens_details.cached_tokens)
        assert d.choices[0].text == llm.generate([prompt], params)[0].text
    assert cached == [0, 144]  # 9 pages of 16: never the prompt's last token
    wait_pd_idle(prefill)
    ranks = _ranks_agree(prefill)
    assert ranks[0]["dense_kv_slots_used"] > 0  # the cache's pages, alike on both ranks
    _wait_free_everywhere(prefill)
    _wait_free_everywhere(decode)


@pytest.mark.parametrize(("mode", "regions"), [("hisparse", 3), ("dense", 3)])
def test_received_memory_is_mapped_by_both_ranks_and_one_receiver(servers, mode, regions):
    """The regions prefill writes (HiSparse: the shared host pool and the indexer-key / scale staging; dense: the
    three staging areas) are the same shared-memory regions in both ranks, already unlinked; one receiver, rank 0's,
    registered them."""
    decode = servers[mode]
    maps = [_shared_regions(pid) for pid in _rank_pids(decode)]
    assert len(maps[0]) >= regions and maps[0] == maps[1], maps
    assert all(name.endswith("(deleted)") for name in maps[0])
    engine = httpx.get(decode.url + "/server_info", timeout=10).json()["engine"]
    assert engine["disaggregation"]["mode"] == "decode" and engine["disaggregation"]["control_endpoint"]
    assert disagg_stats(decode)["registered_bytes"] > 0


@pytest.mark.parametrize("mode", ["hisparse", "dense"])
def test_failed_transfer_frees_every_rank(servers, mode):
    """Prefill's bootstrap address answers nobody: rank 0's room fails (bootstrap timeout, 4 s here), the failure
    is broadcast, and both ranks end the request (503) and free its pages and staging rows."""
    from api_server_harness import free_port

    decode = servers[mode]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0,
            "extra_body": {"bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(),
                           "bootstrap_room": next(_rooms)}}  # fmt: skip

    error = refused_completion(decode, body)
    assert error.status_code == 503 and "bootstrap timeout" in str(error)
    assert disagg_stats(decode)["failures_by_cause"].get("bootstrap_timeout", 0) >= 1
    _wait_free_everywhere(decode)


def test_client_leaving_mid_transfer_frees_every_rank(servers):
    """The client leaves while decode's room waits for prefill (prefill never got the request): rank 0 aborts the
    room, both ranks hold the pages until prefill acknowledged, then free them; prefill refuses the room later."""
    prefill, decode = servers["prefill"], servers["hisparse"]
    route = prefill.route(next(_rooms))
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True, **route}
    with httpx.Client(timeout=60) as c, c.stream("POST", decode.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        wait_for(lambda: disagg_stats(decode)["rooms_by_state"].get("WAITING") == 1, what="decode's room sent")
        ranks = _ranks_agree(decode)
        assert all(r["host_pages_used"] > 0 for r in ranks)  # both ranks admitted it and hold its pages
    _wait_free_everywhere(decode)
    r = httpx.post(prefill.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, **route})
    assert r.status_code == 503 and "aborted by decode" in r.json()["error"]["message"]
    wait_pd_idle(prefill)


def test_tp_prefill_room_failures_free_every_rank(servers):
    """A TP prefill server's rooms that end badly: one whose decode never sends the destination (prefill's bootstrap
    timeout, 4 s here: the request never entered the engine), and one that decode aborted before prefill got the
    request (refused at once with 'aborted by decode'). Rank 0's sender events are applied by both ranks alike, and
    both ranks end up with nothing held."""
    prefill, decode = servers["prefill_tp2"], servers["hisparse"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, **prefill.route(next(_rooms))}
    r = httpx.post(prefill.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 503 and "bootstrap timeout" in r.json()["error"]["message"]
    route = prefill.route(next(_rooms))
    stream = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True, **route}
    with httpx.Client(timeout=60) as c, c.stream("POST", decode.url + "/v1/completions", json=stream) as resp:
        assert resp.status_code == 200
        wait_for(lambda: disagg_stats(decode)["rooms_by_state"].get("WAITING") == 1, what="decode's room sent")
    _wait_free_everywhere(decode)
    r = httpx.post(prefill.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, **route})
    assert r.status_code == 503 and "aborted by decode" in r.json()["error"]["message"]
    d = _wait_free_everywhere(prefill) and disagg_stats(prefill)
    assert d["failures_by_cause"].get("bootstrap_timeout", 0) >= 1
    engine = httpx.get(prefill.url + "/server_info", timeout=10).json()["engine"]
    assert engine["disaggregation"]["mode"] == "prefill" and engine["disaggregation"]["bootstrap_port"]
