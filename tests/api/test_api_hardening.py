"""Issue 14 on real servers: chats without max_tokens on a cache smaller than the context, no head-of-line
blocking, tokenization off the event loop, invalid Unicode, strict types, roles, /health's body, counted
refusals. The module's servers have a 320-token KV cache (20 pages of 16) and a 65 536-token context."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from api_server_harness import ServerProcess, wait_until_idle
from openai import OpenAI

MODEL = "tiny-dsa"
PAGE = 16
CACHE_PAGES = 20
DENSE_TOKEN_BYTES = 3 * (576 * 4 + 132)  # tiny-dsa in float32: MLA row + indexer key, 3 layers
HOST_PAGE_BYTES = PAGE * 576 * 4 * 3
SMALL_CACHE = {
    "dense": ["--device-kv-budget", str(CACHE_PAGES * PAGE * DENSE_TOKEN_BYTES)],
    "hisparse": ["--enable-hisparse", "--host-kv-budget", str(CACHE_PAGES * HOST_PAGE_BYTES),
                 "--hisparse-config", '{"device_buffer_size": 64, "num_recent_slots": 2}'],
}


@pytest.fixture(scope="module", params=["dense", "hisparse"])
def small_server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    server = ServerProcess("--page-size", str(PAGE), "--context-length", "65536",
                           *SMALL_CACHE[request.param]).wait_ready()  # fmt: skip
    try:
        yield server
    finally:
        server.kill()


def engine_stats(server: ServerProcess, timeout: float = 120) -> dict:
    """Engine stats; /server_info answers 503 while one engine step runs long (a loaded CPU), so retry."""
    deadline = time.monotonic() + timeout
    while True:
        info = httpx.get(server.url + "/server_info", timeout=30).json()
        if "stats" in info or time.monotonic() > deadline:
            return info["stats"]
        time.sleep(0.2)


def post(server: ServerProcess, path: str, body: object, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=timeout)


def test_cache_smaller_than_the_context(small_server: ServerProcess) -> None:
    info = httpx.get(small_server.url + "/server_info", timeout=10).json()
    assert info["engine"]["max_request_tokens"] == CACHE_PAGES * PAGE
    assert info["context_length"] == 65536


def test_chat_without_max_tokens_is_served(small_server: ServerProcess) -> None:
    """Most OpenAI clients send no max_tokens: the default is "to the end", clamped to what the cache holds; it
    used to be refused because the engine reserved the whole context up front. Read a few tokens, then leave."""
    client = OpenAI(base_url=small_server.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello!"}],
                                            temperature=0, stream=True)  # fmt: skip
    pieces = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            pieces += 1
        if pieces >= 3 or (chunk.choices and chunk.choices[0].finish_reason):
            break
    stream.close()
    assert pieces >= 1
    wait_until_idle(small_server, timeout=60)


def test_prompt_larger_than_the_cache_is_400_and_n_times_a_fitting_prompt_is_served(
    small_server: ServerProcess,
) -> None:
    too_big = post(small_server, "/v1/completions", {"model": MODEL, "prompt": [7] * 330, "max_tokens": 1})
    assert too_big.status_code == 400, too_big.text
    assert too_big.json()["error"]["type"] == "invalid_request_error"
    # 4 choices of a 200-token prompt (800 tokens in all) on a 320-token cache: one after another, never refused.
    r = post(small_server, "/v1/completions", {"model": MODEL, "prompt": [7] * 200, "max_tokens": 1, "n": 4})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    wait_until_idle(small_server, timeout=60)


def test_short_request_is_not_blocked_behind_large_ones(small_server: ServerProcess) -> None:
    """Three requests that may each grow to 16 of the 20 pages: one runs, two cannot fit yet. A short request
    sent after them is admitted at once (memory for it exists) and answers while they still wait."""
    large = {"model": MODEL, "prompt": [11] * 150, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
    results: list[int] = []

    def send_large() -> None:
        results.append(post(small_server, "/v1/completions", large, timeout=600).status_code)

    threads = [threading.Thread(target=send_large) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = engine_stats(small_server)
        if stats["num_running_reqs"] == 1 and stats["num_queue_reqs"] == 2:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"expected 1 running and 2 waiting: {stats}")
    r = post(small_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert engine_stats(small_server)["num_queue_reqs"] >= 1, "the short request should not have waited for them"
    httpx.post(small_server.url + "/abort_request", json={"abort_all": True}, timeout=10)
    for t in threads:
        t.join(120)
    assert results == [200, 200, 200]
    wait_until_idle(small_server, timeout=60)


def test_health_stays_fast_while_megabyte_prompts_are_tokenized(small_server: ServerProcess) -> None:
    """Four concurrent 1 MB prompts (about 580 000 tokens each, beyond the 65 536-token context, so each is
    refused with 400 after tokenization) while /health is polled; a 3 MB prompt is refused before tokenization."""
    if "--enable-hisparse" in small_server.proc.args:
        pytest.skip("the api process is the same in both modes")
    text = ("hello world, this is some text " * 40000)[:1_000_000]
    payload = json.dumps({"model": MODEL, "prompt": text}).encode()  # encoded once: the client threads only send
    statuses: list[int] = []

    def send() -> None:
        r = httpx.post(small_server.url + "/v1/completions", content=payload, timeout=120,
                       headers={"content-type": "application/json"})  # fmt: skip
        statuses.append(r.status_code)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    worst = 0.0
    with httpx.Client(timeout=10) as http:
        while any(t.is_alive() for t in threads):
            t0 = time.monotonic()
            assert http.get(small_server.url + "/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.02)
    assert statuses == [400] * 4
    assert worst < 0.1, f"/health took {worst:.3f} s while prompts were tokenized"
    t0 = time.monotonic()
    r = post(small_server, "/v1/completions", {"model": MODEL, "prompt": text * 3})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5


INVALID_UNICODE = [
    ("/v1/completions", {"prompt": "ab\ud800cd"}),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}),
    ("/v1/completions", {"prompt": "x", "stop": ["\ud800"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "ab\ud800cd"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "user": "\ud83d"}),
]


@pytest.mark.parametrize(("path", "body"), INVALID_UNICODE)
def test_lone_surrogates_are_a_clear_400(dense_server: ServerProcess, path: str, body: dict) -> None:
    payload = json.dumps({"model": MODEL, "max_tokens": 2, **body}).encode()  # ensure_ascii: legal JSON escapes
    r = httpx.post(dense_server.url + path, content=payload, timeout=60,
                   headers={**dense_server.headers, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text
    assert "unicode" in r.json()["error"]["message"].lower()


def test_valid_surrogate_pairs_are_served(dense_server: ServerProcess) -> None:
    payload = json.dumps({"model": MODEL, "prompt": "emoji \ud83d\ude00 ok", "max_tokens": 2}).encode()
    r = httpx.post(dense_server.url + "/v1/completions", content=payload, timeout=60,
                   headers={**dense_server.headers, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 200, r.text


STRICT = [
    {"stream": "yes"}, {"stream": 1}, {"max_tokens": "5"}, {"max_tokens": 5.0}, {"n": "2"}, {"ignore_eos": "true"},
    {"temperature": "0.5"}, {"stream_options": {"include_usage": "yes"}}, {"echo": 0}, {"seed": True},
]


@pytest.mark.parametrize("override", STRICT)
def test_types_are_strict(dense_server: ServerProcess, override: dict) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **override}
    r = post(dense_server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == next(iter(override)).split(".")[0] or r.json()["error"]["param"]


@pytest.mark.parametrize("prompt", ["", [""], ["ok", ""], [], [[]]])
def test_empty_prompt_is_400(dense_server: ServerProcess, prompt: object) -> None:
    r = post(dense_server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_developer_role_is_a_system_message_and_tool_role_needs_a_template_for_it(
        dense_server: ServerProcess) -> None:
    client = OpenAI(base_url=dense_server.url + "/v1", api_key=dense_server.api_key, max_retries=0)
    out = client.chat.completions.create(
        model=MODEL, max_tokens=2, temperature=0,
        messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    )
    assert out.choices[0].finish_reason in ("length", "stop")
    # A tool's answer is a valid message; the embedded model's template renders no tool role: a 400, not a 500.
    r = post(dense_server, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "user", "content": "Hi"}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "unsupported role: tool" in r.json()["error"]["message"]
    schema = httpx.get(dense_server.url + "/openapi.json", headers=dense_server.headers, timeout=10).json()
    roles = schema["components"]["schemas"]["ChatMessage"]["properties"]["role"]["enum"]
    assert "tool" in roles and "developer" in roles


def test_health_answers_json(dense_server: ServerProcess) -> None:
    r = httpx.get(dense_server.url + "/health", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert body["status"] == "ok" and body["engine"] in ("running", "busy") and body["engine_pid"]


def _rejected(server: ServerProcess) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("sglang:num_rejected_requests_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1: line.index("}")].split(","))
            out[(labels["status"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_every_refusal_is_counted_by_status_and_reason(dense_server: ServerProcess) -> None:
    before = _rejected(dense_server)
    post(dense_server, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"})  # validation
    httpx.post(dense_server.url + "/v1/completions", content=b"{not json", timeout=10,
               headers={**dense_server.headers, "content-type": "application/json"})  # fmt: skip
    httpx.post(dense_server.url + "/v1/completions", json={"prompt": "x"}, timeout=10)  # no key: 401
    httpx.get(dense_server.url + "/v1/nothing", headers=dense_server.headers, timeout=10)  # 404
    post(dense_server, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})  # handler's 400
    after = _rejected(dense_server)

    def delta(key: tuple[str, str]) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta(("400", "invalid_request_error")) == 3
    assert delta(("401", "authentication_error")) == 1
    assert delta(("404", "not_found_error")) == 1


def test_body_over_the_limit_is_413(dense_server: ServerProcess) -> None:
    from decode_server.api.limits import MAX_BODY_BYTES

    r = httpx.post(dense_server.url + "/v1/completions", content=b" " * (MAX_BODY_BYTES + 1), timeout=60,
                   headers={**dense_server.headers, "content-type": "application/json"})  # fmt: skip
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_stream_content_type_is_documented_one(dense_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
    with httpx.stream("POST", dense_server.url + "/v1/completions", json=body, headers=dense_server.headers,
                      timeout=60) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert lines[-1] == "data: [DONE]"
