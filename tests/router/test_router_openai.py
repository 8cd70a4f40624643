"""The official `openai` client through the router: completions, chat, streaming with usage, 16 concurrent
greedy requests equal to the colocated engine, OpenAI-style errors identical to the servers', client
disconnects freeing both workers, /v1/models, /health and /metrics; SGLang's native /generate (one prompt, a batch
with a room per prompt, a stream) equal to the colocated engine."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from api_server_harness import post_and_disconnect
from router_harness import MODEL, RouterProcess, Worker, wait_all_idle

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams

PROMPTS = [f"Prompt number {i}: tell me about the number {i * 7}" for i in range(16)]
SHORT_BODY = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
LONG = {"model": MODEL, "prompt": "Long story:", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def client(router: RouterProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_ids(llm: LLM, content: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def test_completion_equals_colocated_engine(client: openai.OpenAI, offline_llm: LLM) -> None:
    out = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=6, temperature=0)
    expected = offline_llm.generate(["Hello world"], SamplingParams(max_tokens=6, temperature=0))[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.id.startswith("cmpl-")


def test_batched_prompts_equal_colocated_engine(client: openai.OpenAI, offline_llm: LLM) -> None:
    """A list of prompts: in PD each prompt is its own transfer (the router sends one room per prompt)."""
    prompts = ["First prompt", "Second one", "And a third"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    expected = offline_llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0))
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == [e.text for e in expected]


def test_chat_equals_colocated_engine(client: openai.OpenAI, offline_llm: LLM) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=6, temperature=0
    )
    expected = offline_llm.generate([_chat_ids(offline_llm, "Hello!")], SamplingParams(max_tokens=6, temperature=0))
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.content == expected[0].text
    assert out.usage is not None and out.usage.total_tokens == out.usage.prompt_tokens + 6


def test_streaming_completion_with_usage(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert len([c for c in chunks if c.choices]) > 1, "the stream came in one piece"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    assert len({c.id for c in chunks}) == 1


def test_streaming_chat_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Stream me something"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_16_concurrent_greedy_equal_colocated_engine(router: RouterProcess, offline_llm: LLM) -> None:
    expected = [o.text for o in offline_llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0))]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        async with aclient:
            outs = await asyncio.gather(*(aclient.completions.create(model=MODEL, prompt=p, max_tokens=8,
                                                                     temperature=0) for p in PROMPTS))  # fmt: skip
        return [o.choices[0].text for o in outs]

    assert asyncio.run(run_all()) == expected


BAD_BODIES = [
    b'{"model": "tiny-dsa", "prompt": ',  # not JSON
    b"[1, 2, 3]",  # not an object
    b"",  # no body
    b'{"model": "tiny-dsa"}',  # no prompt
    b'{"model": "tiny-dsa", "prompt": "x", "temperature": 7}',
    b'{"model": "tiny-dsa", "prompt": "x", "max_tokens": 0}',
    b'{"model": "tiny-dsa", "prompt": "x", "n": 99}',
    b'{"model": "nope", "prompt": "x"}',  # the worker's own check (model name), passed through
    b'{"model": "tiny-dsa", "prompt": "x", "suffix": "y"}',  # unsupported parameter (worker's check)
]


@pytest.mark.parametrize("raw", BAD_BODIES)
def test_bad_input_gets_the_servers_openai_error(router: RouterProcess, workers: tuple, raw: bytes) -> None:
    _, decode = workers
    headers = {"Content-Type": "application/json"}
    via_router = httpx.post(router.url + "/v1/completions", content=raw, headers=headers, timeout=30)
    direct = httpx.post(decode[0].url + "/v1/completions", content=raw, headers=headers, timeout=30)
    assert via_router.status_code == 400, via_router.text
    body = via_router.json()
    assert set(body) == {"error"} and body["error"]["code"] == 400
    assert body["error"]["type"] == "invalid_request_error"
    if raw == BAD_BODIES[0]:  # the parsers' texts differ (FastAPI's vs the json module's)
        assert body["error"]["message"].startswith("request body is not valid JSON")
    else:
        assert body == direct.json()


def test_bad_chat_input(router: RouterProcess) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(router.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, timeout=30)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.role"


def test_unknown_route_and_method(router: RouterProcess) -> None:
    r = httpx.get(router.url + "/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(router.url + "/v1/completions", timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == 405


def test_trailing_slash_redirects_like_the_servers(router: RouterProcess, workers: tuple) -> None:
    """`/v1/completions/` gets the servers' 307 to `/v1/completions` (method and body kept by the client)."""
    _, decode = workers
    for path in ("/v1/completions/", "/v1/chat/completions/"):
        via_router = httpx.post(router.url + path, json=SHORT_BODY, timeout=30)
        direct = httpx.post(decode[0].url + path, json=SHORT_BODY, timeout=30)
        assert via_router.status_code == direct.status_code == 307
        assert via_router.headers["location"] == router.url + path.rstrip("/")
        assert direct.headers["location"] == decode[0].url + path.rstrip("/")
    followed = httpx.post(router.url + "/v1/completions/", json=SHORT_BODY, timeout=60, follow_redirects=True)
    assert followed.status_code == 200 and followed.json()["object"] == "text_completion", followed.text


def test_native_generate_equals_colocated_engine(router: RouterProcess, offline_llm: LLM) -> None:
    """/generate through the router, as SGLang's router relays it: one prompt, a batch (one room per prompt), a
    stream of cumulative outputs; the decode server's answers are the colocated engine's."""
    sampling = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = ["First prompt", "Second one"]
    expected = offline_llm.generate(prompts, params)
    one = httpx.post(router.url + "/generate", json={"text": prompts[0], "sampling_params": sampling}, timeout=60)
    assert one.status_code == 200, one.text
    assert one.json()["output_ids"] == expected[0].token_ids and one.json()["meta_info"]["id"].startswith("gen-")
    batch = httpx.post(router.url + "/generate", json={"text": prompts, "sampling_params": sampling}, timeout=60)
    assert batch.status_code == 200, batch.text
    assert [o["text"] for o in batch.json()] == [e.text for e in expected]
    with httpx.stream("POST", router.url + "/generate", timeout=60,
                      json={"text": prompts[1], "sampling_params": sampling, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and len(lines) == 6
    assert json.loads(lines[-2][len("data: "):])["output_ids"] == expected[1].token_ids
    bad = httpx.post(router.url + "/generate", json={"text": "x", "sampling_params": {"temperature": 9}}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.temperature"


def test_openapi_lists_the_generation_routes(router: RouterProcess) -> None:
    """The generation routes are served outside FastAPI (the fast path) but still documented, with the servers'
    request models as their bodies."""
    spec = httpx.get(router.url + "/openapi.json", timeout=10).json()
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/generate", "GenerateRequest")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].endswith("/" + model)
    assert model in spec["components"]["schemas"] and "/health" in spec["paths"]


def test_models_health_metrics(router: RouterProcess, workers: tuple) -> None:
    prefill, decode = workers
    models = httpx.get(router.url + "/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert httpx.get(router.url + f"/v1/models/{MODEL}", timeout=10).json()["id"] == MODEL
    missing = httpx.get(router.url + "/v1/models/gpt-4", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    info = httpx.get(router.url + "/get_model_info", timeout=10).json()  # SGLang's frontend reads it
    assert info["is_generation"] is True and info["served_model_name"] == MODEL
    health = router.health()
    assert health.status_code == 200
    body = health.json()
    assert [w["url"] for w in body["workers"]["prefill"]] == [w.url for w in prefill]
    assert [w["bootstrap_port"] for w in body["workers"]["prefill"]] == [w.bootstrap_port for w in prefill]
    assert all(w["healthy"] for w in body["workers"]["prefill"] + body["workers"]["decode"])
    for w in prefill + decode:
        assert router.metric("hisparse_router:worker_healthy", role=w.role, worker=w.url) == 1
    assert router.metric("hisparse_router:request_latency_seconds_count", route="/v1/completions") >= 1
    assert router.metric("hisparse_router:time_to_first_byte_seconds_count", route="/v1/completions") >= 1
    assert router.metric("hisparse_router:client_requests_total", route="/v1/completions", status="200") >= 1
    assert router.metric("hisparse_router:client_requests_total", route="/v1/completions", status="400") >= 1


def _aborts(router: RouterProcess, workers: list[Worker]) -> float:
    return sum(router.metric("hisparse_router:aborts_sent_total", role=w.role, worker=w.url) for w in workers)


def test_stream_disconnect_frees_both_workers(router: RouterProcess, workers: tuple) -> None:
    prefill, decode = workers
    everyone = prefill + decode
    wait_all_idle(everyone)
    before = {w.url: w.server.stats()["num_generated_tokens"] for w in everyone}
    aborts = _aborts(router, everyone)
    with httpx.stream("POST", router.url + "/v1/completions", json=dict(LONG, stream=True), timeout=60) as r:
        assert r.status_code == 200
        data_lines = 0
        for line in r.iter_lines():
            data_lines += line.startswith("data: ")
            if data_lines == 3:
                running = sum(w.server.stats()["num_running_reqs"] for w in decode)
                assert running == 1
                break  # leaving the iterator closes the connection mid-stream
    wait_all_idle(everyone, timeout=20)
    generated = {w.url: w.server.stats()["num_generated_tokens"] - before[w.url] for w in everyone}
    assert all(n < 200 for n in generated.values()), f"a worker ran the request to the end: {generated}"
    assert _aborts(router, everyone) - aborts == 2  # one abort to each worker of the pair


def test_non_streaming_disconnect_frees_both_workers(router: RouterProcess, workers: tuple) -> None:
    prefill, decode = workers
    everyone = prefill + decode
    wait_all_idle(everyone)
    before = {w.url: w.server.stats()["num_generated_tokens"] for w in everyone}
    post_and_disconnect(router.url + "/v1/completions", LONG,
                        working=lambda: sum(w.server.stats()["num_running_reqs"] for w in decode) == 1)  # fmt: skip
    wait_all_idle(everyone, timeout=20)
    generated = {w.url: w.server.stats()["num_generated_tokens"] - before[w.url] for w in everyone}
    assert all(n < 200 for n in generated.values()), f"a worker ran the request to the end: {generated}"


def test_sse_frames_passed_through_unchanged(router: RouterProcess) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(r.iter_raw())
    frames = [f for f in raw.decode().split("\n\n") if f]
    assert frames[-1] == "data: [DONE]"
    for frame in frames[:-1]:
        assert frame.startswith("data: ")
        assert json.loads(frame[len("data: "):])["object"] == "text_completion"
