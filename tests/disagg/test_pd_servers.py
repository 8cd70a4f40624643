"""PD disaggregation end to end: a prefill server and decode servers (HiSparse on and off) as real
`decode-server serve` processes, real mooncake over TCP on 127.0.0.1 between them, driven with the openai client
the way a PD router does it (the same body, with bootstrap fields, to both servers at once).

Correctness: greedy tokens and logprobs equal colocated serving bit for bit. Requests go one at a time, so that
each forward pass has the same batch in both set-ups (batch composition changes float rounding; see
docs/architecture.md); 16 concurrent requests then check the same tokens under load. Faults: missing bootstrap
fields, bootstrap unreachable, waiting timeout, prefill's bootstrap timeout, an abort on decode reaching prefill,
an abort on prefill, a refused handshake. After each, both sides' pools, staging rows and rooms are empty."""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from pd_harness import (
    HISPARSE_CONFIG,
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
from prometheus_client.parser import text_string_to_metric_families

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

CONTEXT_LENGTH = 256
MAX_TOKENS = 5
# Token-id prompts of different lengths: shorter and longer than the decode buffer (64), one of several chunks.
PROMPTS = [[(7 * i + 3 * n) % 900 + 5 for i in range(n)] for n in (6, 70, 150)]
_rooms = itertools.count(1_000)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict]:
    # Prefix caching on: the tests that send a prompt again (the greedy one, once per decode mode) take its prefix
    # from the cache, and the decode side must still receive every row (test_pd_prefill_reuses_a_cached_prefix).
    prefill = PrefillServer("--enable-prefix-caching")
    # The dense decode has a short waiting timeout (its test); its other requests go one at a time.
    decodes = {"hisparse": decode_server(hisparse=True), "dense": decode_server(hisparse=False, waiting_timeout_s=10)}
    mismatched = decode_server("--kv-cache-dtype", "bfloat16", hisparse=True)
    single = decode_server("--max-running-requests", "1", hisparse=True)  # a second request waits for admission
    everyone = [prefill, *decodes.values(), mismatched, single]
    start_all(*everyone)
    registered = {s.url: disagg_stats(s)["registered_bytes"] for s in everyone}
    try:
        yield {"prefill": prefill, **decodes, "mismatched": mismatched, "single": single,
               "registered_at_start": registered}
    finally:
        for s in everyone:
            s.kill()


def _client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _body(prompt, room_fields: dict, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 2,
            "extra_body": {"ignore_eos": True, **room_fields}, **extra}


async def _pd_request(prefill, decode, prompt, **extra):
    """What a router does: the same body to both, concurrently; the decode server's answer is the result."""
    body = _body(prompt, prefill.route(next(_rooms)), **extra)
    async with _client(prefill) as pc, _client(decode) as dc:
        p, d = await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))
    return p, d


def _colocated(hisparse: bool, **extra) -> LLM:
    kwargs = {"enable_hisparse": True, "hisparse": {"device_buffer_size": 64, "num_recent_slots": 4}} if hisparse \
        else {}
    return LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH, **kwargs, **extra)


@pytest.mark.parametrize("mode", ["hisparse", "dense"])
def test_pd_greedy_equals_colocated(servers, mode):
    assert '"device_buffer_size": 64' in HISPARSE_CONFIG
    prefill, decode = servers["prefill"], servers[mode]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    llm = _colocated(hisparse=mode == "hisparse")
    # Prefill computes every prompt whole, as colocated does (a prompt sent before would start after its cached
    # prefix: the same tokens, but not the same bits; test_pd_prefill_reuses_a_cached_prefix).
    wait_pd_idle(prefill)
    flush_cache(prefill)
    for prompt in PROMPTS:
        (expected,) = llm.generate([prompt], params)
        p, d = asyncio.run(_pd_request(prefill, decode, prompt))
        lp = d.choices[0].logprobs
        assert d.choices[0].text == expected.text and d.choices[0].finish_reason == "length"
        assert lp.token_logprobs == [x.logprob for x in expected.logprobs]  # bit for bit
        assert [list(t.values()) for t in lp.top_logprobs] == [[v for _, v in x.top_logprobs] for x in expected.logprobs]
        assert d.usage.completion_tokens == MAX_TOKENS and d.usage.prompt_tokens == len(prompt)
        # prefill answers with the first token only (its KV went to decode)
        assert p.choices[0].text == lp.tokens[0] and p.usage.completion_tokens == 1
        assert p.choices[0].logprobs.token_logprobs == lp.token_logprobs[:1]
    for server in (prefill, decode):
        d = wait_pd_idle(server)
        assert d["rooms_finished"].get("SUCCESS", 0) >= len(PROMPTS) and not d["failures_by_cause"]
    assert disagg_stats(decode)["transfer_bytes"] > 0


@pytest.mark.parametrize("mode", ["hisparse", "dense"])
def test_pd_prefill_reuses_a_cached_prefix(servers, mode):
    """A prompt sharing 150 tokens with an earlier one: prefill maps the 9 cached pages of 16 and computes the rest
    only, and the cached rows go to decode with that first chunk. Decode's greedy tokens and logprobs equal colocated
    serving's with prefix caching bit for bit (it computes the same chunks; a missing row would change them), and
    its tokens equal those of colocated serving without a cache."""
    prefill, decode = servers["prefill"], servers[mode]
    shared = [(11 * i + (mode == "dense") * 400) % 900 + 5 for i in range(150)]  # a prefix of its own per mode
    prompts = [shared + [7, 8, 9], shared + [10, 11, 12, 13]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=2)
    caching = _colocated(hisparse=mode == "hisparse", enable_prefix_caching=True, page_size=16)
    uncached = _colocated(hisparse=mode == "hisparse")
    cached = []
    for prompt in prompts:
        (want,) = caching.generate([prompt], params)  # one at a time, as the servers get them
        p, d = asyncio.run(_pd_request(prefill, decode, prompt))
        cached.append(p.usage.prompt_tokens_details.cached_tokens)
        assert d.usage.prompt_tokens_details is None  # decode runs without prefix caching
        assert d.choices[0].text == want.text and d.usage.prompt_tokens == len(prompt)
        assert d.choices[0].logprobs.token_logprobs == [x.logprob for x in want.logprobs]  # bit for bit
        assert d.choices[0].text == uncached.generate([prompt], params)[0].text
    assert cached == [0, 9 * 16]
    assert caching.engine.stats().prefix_cache.hit_tokens == 9 * 16  # the reference did reuse the prefix too
    for server in (prefill, decode):
        d = wait_pd_idle(server)
        assert not d["failures_by_cause"]
    cache = prefill.stats()["prefix_cache"]
    assert cache["hit_tokens"] >= 9 * 16 and cache["cached_tokens"] == cache["evictable_tokens"] > 0


def test_pd_seeded_sampling_equals_colocated(servers):
    """Sampling with a seed: every output token is drawn from (seed, its index), so the decode server, which starts
    at token 1, continues exactly as a colocated server does (HiSparse decode; logits are bit-identical)."""
    prefill, decode = servers["prefill"], servers["hisparse"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.3, top_p=0.95, seed=1234, ignore_eos=True)
    llm = _colocated(hisparse=True)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    differs_from_greedy = 0
    for prompt in PROMPTS:
        (expected,) = llm.generate([prompt], params)
        _, d = asyncio.run(_pd_request(prefill, decode, prompt, temperature=1.3, top_p=0.95, seed=1234))
        assert d.choices[0].text == expected.text
        differs_from_greedy += expected.token_ids != llm.generate([prompt], greedy)[0].token_ids
    assert differs_from_greedy  # it really sampled
    for server in (prefill, decode):
        wait_pd_idle(server)


def test_pd_penalties_and_min_tokens_equal_colocated(servers):
    """Penalties count the output so far: the decode server, whose first token came from the prefill server, counts
    it too (its counts start from the tokens it knows), and min_tokens holds EOS back on both sides alike."""
    prefill, decode = servers["prefill"], servers["hisparse"]
    llm = _colocated(hisparse=True)
    eos = min(llm.engine.eos_token_ids)
    wait_pd_idle(prefill)
    flush_cache(prefill)
    for prompt in PROMPTS:
        favoured = sorted(set(llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0].token_ids))[:3]
        edits = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "logit_bias": {t: 6.0 for t in favoured}}
        extra = {"repetition_penalty": 1.5, "min_tokens": 6}
        params = SamplingParams(max_tokens=10, temperature=0, **edits, **extra)
        params_eos = params.model_copy(update={"logit_bias": {**edits["logit_bias"], eos: 100.0}})
        for p in (params, params_eos):
            (expected,) = llm.generate([prompt], p)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, **edits,
                    "logit_bias": {str(t): v for t, v in p.logit_bias.items()},
                    "extra_body": {**extra, **prefill.route(next(_rooms))}}

            async def both(body=body):
                async with _client(prefill) as pc, _client(decode) as dc:
                    return await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))

            _, d = asyncio.run(both())
            assert d.choices[0].text == expected.text, (prompt[:3], p.logit_bias)
            assert d.usage.completion_tokens == len(expected.token_ids)
        assert len(expected.token_ids) == 7 and expected.finish_reason == "stop"  # EOS as token 6, not before
    for server in (prefill, decode):
        wait_pd_idle(server)


def test_pd_structured_output_equals_colocated(servers):
    """A grammar spans both servers: prefill samples the first token under it, and the decode server's matcher
    starts from that token; sampled and greedy outputs equal a colocated engine's and match their grammar."""
    pytest.importorskip("xgrammar")
    from decode_server.engine.sampling_params import StructuredOutput

    prefill, decode = servers["prefill"], servers["hisparse"]
    llm = _colocated(hisparse=True)
    regex = r"(yes|no), [0-9]{2,4}!"
    wait_pd_idle(prefill)
    flush_cache(prefill)
    for i, prompt in enumerate(PROMPTS):
        sampling = {"temperature": 0} if i % 2 else {"temperature": 0.9, "seed": 7 + i}
        params = SamplingParams(max_tokens=12, structured=StructuredOutput(kind="regex", spec=regex), **sampling)
        (expected,) = llm.generate([prompt], params)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, **sampling,
                "extra_body": {"regex": regex, **prefill.route(next(_rooms))}}

        async def both(body=body):
            async with _client(prefill) as pc, _client(decode) as dc:
                return await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))

        _, d = asyncio.run(both())
        assert d.choices[0].text == expected.text and re.fullmatch(regex, expected.text), expected.text
        assert d.choices[0].finish_reason == "stop"
    for server in (prefill, decode):
        wait_pd_idle(server)


def test_pd_streaming_chat_and_16_concurrent(servers):
    prefill, decode = servers["prefill"], servers["hisparse"]
    llm = _colocated(hisparse=True)
    prompts = [PROMPTS[2][i : i + 8 + 2 * i] for i in range(16)]
    expected = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0,
                                                                          ignore_eos=True))]

    async def one(i: int):
        body = _body(prompts[i], prefill.route(next(_rooms)), stream=i % 2 == 0)
        body["logprobs"], body["max_tokens"] = 0, 3
        async with _client(prefill) as pc, _client(decode) as dc:
            p, d = await asyncio.gather(pc.completions.create(**body), dc.completions.create(**body))
            if body["stream"]:
                chunks = [c async for c in d]
                async for _ in p:
                    pass
                return [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices else [])]
            return d.choices[0].logprobs.tokens

    async def run() -> list:
        return await asyncio.gather(*(one(i) for i in range(16)))

    got = asyncio.run(run())
    tok = llm.tokenizer
    assert got == [[tok.decode([t], skip_special_tokens=False) for t in ids] for ids in expected]
    for server in (prefill, decode):
        wait_pd_idle(server)

    # chat, streamed: the first token arrives as a delta from decode, as in colocated serving
    async def chat():
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3,
                "temperature": 0, "stream": True, "extra_body": prefill.route(next(_rooms))}
        async with _client(prefill) as pc, _client(decode) as dc:
            _, d = await asyncio.gather(pc.chat.completions.create(**body), dc.chat.completions.create(**body))
            return [c async for c in d]

    chunks = asyncio.run(chat())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    wait_pd_idle(decode)


def test_pd_metrics_on_both_roles(servers):
    for name in ("prefill", "hisparse"):
        text = httpx.get(servers[name].url + "/metrics", timeout=10).text
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["sglang:kv_transfer_bytes_total"].value > 0
        assert samples["sglang:kv_transfer_latency_seconds_count"].value > 0
        assert "sglang:kv_transfer_rooms" in samples and "sglang:kv_transfer_registered_bytes" in samples
    names = {s.name for f in text_string_to_metric_families(httpx.get(servers["prefill"].url + "/metrics").text)
             for s in f.samples}
    assert "sglang:num_prefill_inflight_queue_reqs" in names


def test_without_a_secret_pd_servers_run_and_say_so_loudly(servers):
    """No --disaggregation-auth-secret-file (local development): everything above worked, and both roles report the
    unauthenticated control plane at start-up, in /server_info and in /metrics."""
    for name in ("prefill", "hisparse"):
        server = servers[name]
        assert httpx.get(server.url + "/server_info", timeout=10).json()["disaggregation_auth"] == "off"
        text = httpx.get(server.url + "/metrics", timeout=10).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["sglang:kv_transfer_auth_enabled"] == 0
        log = server.log_text()
        assert "WITHOUT --disaggregation-auth-secret-file" in log  # the api process
        assert "PD control plane NOT authenticated" in log  # the engine process


def test_pd_requests_need_bootstrap_fields(servers):
    for name in ("prefill", "hisparse"):
        url = servers[name].url + "/v1/completions"
        r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert r.status_code == 400 and "bootstrap_room" in r.json()["error"]["message"]
        route = servers["prefill"].route(next(_rooms))
        r = httpx.post(url, json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "n": 2, **route}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = httpx.post(url, json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2, **route}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "bootstrap_room"


def test_pd_batched_prompts_with_room_lists(servers):
    """SGLang's router sends one room per prompt of a batched completion."""
    prefill, decode = servers["prefill"], servers["dense"]
    rooms = [next(_rooms), next(_rooms)]
    body = {"model": MODEL, "prompt": [PROMPTS[0], PROMPTS[1][:30]], "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "bootstrap_host": ["127.0.0.1"] * 2,
            "bootstrap_port": [prefill.bootstrap_port] * 2, "bootstrap_room": rooms}

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(c.post(prefill.url + "/v1/completions", json=body),
                                        c.post(decode.url + "/v1/completions", json=body))

    p, d = asyncio.run(run())
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert [c["index"] for c in d.json()["choices"]] == [0, 1]
    assert d.json()["usage"]["completion_tokens"] == 6
    wait_pd_idle(decode)
    wait_pd_idle(prefill)


def test_pd_native_generate_equals_colocated(servers):
    """SGLang's router sends /generate (its native API) to both servers with the bootstrap fields: decode answers
    colocated serving's greedy tokens and logprobs bit for bit, prefill the first token; a batch takes one room per
    prompt."""
    prefill, decode = servers["prefill"], servers["hisparse"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    (expected,) = _colocated(hisparse=True).generate([PROMPTS[1]], params)
    wait_pd_idle(prefill)
    flush_cache(prefill)  # computed whole, as colocated does
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}

    async def both(body: dict) -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(c.post(prefill.url + "/generate", json=body),
                                        c.post(decode.url + "/generate", json=body))

    p, d = asyncio.run(both({"input_ids": PROMPTS[1], "return_logprob": True, "sampling_params": sampling,
                             **prefill.route(next(_rooms))}))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    out = d.json()
    assert out["output_ids"] == expected.token_ids and out["text"] == expected.text
    assert [e[0] for e in out["meta_info"]["output_token_logprobs"]] == [x.logprob for x in expected.logprobs]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_TOKENS}
    assert p.json()["output_ids"] == expected.token_ids[:1]
    rooms = [next(_rooms), next(_rooms)]
    p, d = asyncio.run(both({"input_ids": [PROMPTS[0], PROMPTS[1][:30]], "sampling_params": {**sampling,
                             "max_new_tokens": 3}, "bootstrap_host": ["127.0.0.1"] * 2,
                             "bootstrap_port": [prefill.bootstrap_port] * 2, "bootstrap_room": rooms}))
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert [len(o["output_ids"]) for o in d.json()] == [3, 3] and [o["index"] for o in d.json()] == [0, 1]
    for server in (prefill, decode):
        stats = wait_pd_idle(server)
        assert not stats["failures_by_cause"], stats


def test_pd_decode_refuses_prompt_logprobs(servers):
    """The prompt is computed by the prefill server: a decode server refuses prompt logprobs at once, naming the
    field each route uses, and holds nothing for the room."""
    decode = servers["dense"]
    route = servers["prefill"].route(next(_rooms))
    for path, body, param in (
        ("/generate", {"input_ids": PROMPTS[0], "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
        ("/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 2, "echo": True, "logprobs": 0}, "echo"),
    ):
        r = httpx.post(decode.url + path, json={**body, **route}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "PD decode" in r.json()["error"]["message"]
    stats = wait_pd_idle(decode)
    assert not stats["failures_by_cause"], stats


def _error_of(exc: openai.APIError) -> str:
    return str(exc.message if hasattr(exc, "message") else exc)


def test_bootstrap_unreachable(servers):
    decode = servers["hisparse"]
    dead_port = _closed_port()
    body = _body(PROMPTS[0], {"bootstrap_host": "127.0.0.1", "bootstrap_port": dead_port,
                              "bootstrap_room": next(_rooms)})

    error = refused_completion(decode, body)
    assert error.status_code == 503 and "bootstrap timeout" in _error_of(error)
    assert "unreachable" in _error_of(error)
    d = wait_pd_idle(decode)
    assert d["failures_by_cause"].get("bootstrap_timeout", 0) >= 1


def _closed_port() -> int:
    from api_server_harness import free_port

    return free_port()


def test_waiting_timeout_streamed_error_event(servers):
    """Only decode gets the request (prefill never runs it): decode's waiting timeout fails it with an error
    event in the stream, after prefill acknowledged the abort (so no write can land in freed pages)."""
    prefill, decode = servers["prefill"], servers["dense"]
    body = _body(PROMPTS[1], prefill.route(next(_rooms)), stream=True)

    async def run():
        async with _client(decode) as dc:
            stream = await dc.completions.create(**body)
            return [c async for c in stream]

    with pytest.raises(openai.APIError) as err:
        asyncio.run(run())
    assert "waiting timeout" in _error_of(err.value)
    d = wait_pd_idle(decode)
    assert d["failures_by_cause"].get("waiting_timeout", 0) >= 1
    wait_pd_idle(prefill)


def test_prefill_bootstrap_timeout(servers):
    """Only prefill gets the request: no decode ever sends the destination."""
    prefill = servers["prefill"]
    body = _body(PROMPTS[0], prefill.route(next(_rooms)))

    error = refused_completion(prefill, body)
    assert error.status_code == 503 and "bootstrap timeout" in _error_of(error)
    d = wait_pd_idle(prefill)
    assert d["failures_by_cause"].get("bootstrap_timeout", 0) >= 1


def test_abort_on_decode_reaches_prefill(servers):
    """A client leaves decode while its room waits for prefill: decode sends ABORT, prefill acknowledges and
    remembers it, so the prefill request of that room fails at once instead of computing for nobody."""
    prefill, decode = servers["prefill"], servers["hisparse"]
    route = prefill.route(next(_rooms))
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, "stream": True, **route}
    before = disagg_stats(prefill)["failures_by_cause"].get("peer", 0)
    with httpx.Client(timeout=60) as c, c.stream("POST", decode.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        wait_for(lambda: disagg_stats(decode)["rooms_by_state"].get("WAITING") == 1, what="decode's room sent")
    # the client is gone: decode aborts the room and frees its pages once prefill acknowledged
    wait_pd_idle(decode)
    r = httpx.post(prefill.url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, **route})
    assert r.status_code == 503 and "aborted by decode" in r.json()["error"]["message"]
    d = wait_pd_idle(prefill)
    assert d["failures_by_cause"].get("peer", 0) == before + 1


def test_abort_before_decode_admission_frees_prefill_at_once(servers):
    """The decode request waits for a running slot (max 1, taken by a long stream) and its client leaves before
    decode ever sent the room: decode still tells prefill, whose request for that room ends with 'aborted by
    decode' instead of waiting for its bootstrap timeout (4 s here, which ends it with 'bootstrap timeout')."""
    prefill, decode = servers["prefill"], servers["single"]
    long_route = prefill.route(next(_rooms))
    long_body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "stream": True,
                 **long_route}
    route = prefill.route(next(_rooms))
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 4, **route}

    async def run() -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:
            first = asyncio.create_task(c.post(prefill.url + "/v1/completions", json=long_body))
            async with c.stream("POST", decode.url + "/v1/completions", json=long_body) as long_stream:
                assert long_stream.status_code == 200
                lines = long_stream.aiter_lines()
                while not (await anext(lines)).startswith("data:"):  # the long request is decoding
                    pass
                waiting = asyncio.create_task(c.post(decode.url + "/v1/completions", json=body))
                await asyncio.to_thread(wait_for, lambda: decode.stats()["num_queue_reqs"] == 1,
                                        what="the second request queued on decode")
                prefill_answer = asyncio.create_task(c.post(prefill.url + "/v1/completions", json=body))
                await asyncio.to_thread(wait_for, lambda: disagg_stats(prefill)["num_bootstrapping_reqs"] == 1,
                                        what="prefill holding the second room for decode")
                waiting.cancel()  # its client leaves while it waits for admission on decode
                start = asyncio.get_running_loop().time()
                answer = await prefill_answer
                elapsed = asyncio.get_running_loop().time() - start
            await first  # leaving the long stream aborted it on decode
            return elapsed, answer

    elapsed, answer = asyncio.run(run())
    assert answer.status_code == 503 and "aborted by decode" in answer.json()["error"]["message"], elapsed
    wait_pd_idle(decode)
    wait_pd_idle(prefill)


def test_abort_on_prefill_frees_the_room(servers):
    prefill = servers["prefill"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 4, "stream": True, **prefill.route(next(_rooms))}
    with httpx.Client(timeout=60) as c, c.stream("POST", prefill.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        wait_for(lambda: disagg_stats(prefill)["num_bootstrapping_reqs"] == 1, what="prefill's room")
    d = wait_pd_idle(prefill)
    assert d["failures_by_cause"].get("local", 0) >= 1


def test_handshake_mismatch_refused(servers):
    """A bf16-KV decode against an fp32-KV prefill: refused at handshake with the differing field named."""
    prefill, decode = servers["prefill"], servers["mismatched"]
    body = _body(PROMPTS[0], prefill.route(next(_rooms)))

    error = refused_completion(decode, body)
    message = _error_of(error)
    assert error.status_code == 503 and "transfer layout mismatch" in message, message
    assert "2304" in message and "1152" in message  # fp32 vs bf16 MLA rows
    wait_pd_idle(decode)


def test_registered_memory_unchanged(servers):
    """Registration happens once, at start: no fault above registered or leaked a buffer."""
    for name in ("prefill", "hisparse", "dense", "mismatched"):
        server = servers[name]
        now = disagg_stats(server)["registered_bytes"]
        assert now > 0 and now == servers["registered_at_start"][server.url], name
