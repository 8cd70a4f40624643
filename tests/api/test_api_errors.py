"""Every error the API promises, on a real server: status code and OpenAI-style body."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from api_server_harness import CONTEXT_LENGTH, ServerProcess

MODEL = "tiny-dsa"


def post(server: ServerProcess, path: str, body: Any = None, *, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:  # fmt: skip
    hdrs = dict(server.headers if headers is None else headers)
    if content is not None:
        hdrs["content-type"] = "application/json"
        return httpx.post(server.url + path, content=content, headers=hdrs, timeout=60)
    return httpx.post(server.url + path, json=body, headers=hdrs, timeout=60)


def assert_error(r: httpx.Response, status: int, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    assert err["type"]
    if param is not None:
        assert err["param"] == param, err
    assert contains.lower() in err["message"].lower(), err
    return err


COMPLETION_400 = [
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": -5}, "max_tokens", ""),
    ({"temperature": 2.5}, "temperature", ""),
    ({"temperature": -0.1}, "temperature", ""),
    ({"top_p": 0}, "top_p", ""),
    ({"top_k": -2}, "top_k", ""),
    ({"n": 17}, "n", ""),
    ({"logprobs": 21}, "logprobs", ""),
    ({"model": "gpt-4"}, "model", "not served"),
    ({"max_tokens": CONTEXT_LENGTH}, "max_tokens", "context length"),
    ({"prompt": "word " * (CONTEXT_LENGTH + 10)}, "prompt", "context length"),
    ({"prompt": [5, 1_000_000]}, "prompt", "vocabulary"),
    ({"prompt": []}, "prompt", "empty"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "stop sequences"),
    ({"stop": [""]}, "stop", "empty"),
    ({"suffix": "x"}, "suffix", "not supported"),
    ({"presence_penalty": 2.5}, "presence_penalty", ""),
    ({"frequency_penalty": -2.1}, "frequency_penalty", ""),
    ({"repetition_penalty": 0}, "repetition_penalty", ""),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"1024": 1}}, "logit_bias", "token ids in [0, 1024)"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias", "twice"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most 1024"),
    ({"min_tokens": 5}, "min_tokens", "more than max_tokens"),
    ({"min_tokens": -1}, "min_tokens", ""),
    ({"best_of": 3}, "best_of", ""),
    ({"max_tokens": "many"}, "max_tokens", ""),
]


@pytest.mark.parametrize(("override", "param", "contains"), COMPLETION_400)
def test_completion_400(dense_server: ServerProcess, override: dict, param: str, contains: str) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **override}
    assert_error(post(dense_server, "/v1/completions", body), 400, param, contains)


CHAT_400 = [
    ({"messages": []}, "messages", ""),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None, ""),
    ({"max_completion_tokens": 0}, "max_completion_tokens", ""),
    ({"max_tokens": CONTEXT_LENGTH}, "max_tokens", "context length"),
    ({"temperature": 7}, "temperature", ""),
    ({"model": "nope"}, "model", "not served"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "--tool-call-parser"),
]


@pytest.mark.parametrize(("override", "param", "contains"), CHAT_400)
def test_chat_400(dense_server: ServerProcess, override: dict, param: str | None, contains: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **override}
    assert_error(post(dense_server, "/v1/chat/completions", body), 400, param, contains)


def test_missing_body_and_fields(dense_server: ServerProcess) -> None:
    assert_error(post(dense_server, "/v1/completions", {"model": MODEL}), 400, "prompt", "missing")
    assert_error(post(dense_server, "/v1/chat/completions", {"model": MODEL}), 400, "messages", "missing")
    assert_error(post(dense_server, "/v1/completions", content=b""), 400)
    assert_error(post(dense_server, "/v1/completions", [1, 2, 3]), 400)


@pytest.mark.parametrize("raw", [b"{bad json", b'{"prompt": "x",}', b"\xff\xfe", b'{"prompt": "x"'])
def test_malformed_json(dense_server: ServerProcess, raw: bytes) -> None:
    assert_error(post(dense_server, "/v1/completions", content=raw), 400)
    assert_error(post(dense_server, "/v1/chat/completions", content=raw), 400)


def test_api_key(dense_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert_error(post(dense_server, "/v1/completions", body, headers={}), 401, contains="missing")
    wrong = {"Authorization": "Bearer wrong-key"}
    assert_error(post(dense_server, "/v1/completions", body, headers=wrong), 401, contains="invalid")
    r = httpx.get(dense_server.url + "/v1/models", timeout=10)
    assert_error(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    # auth comes first: a bad body without a key is still 401
    assert_error(post(dense_server, "/v1/completions", content=b"{bad", headers={}), 401)
    # probes and the scrape target stay open
    assert httpx.get(dense_server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(dense_server.url + "/metrics", timeout=10).status_code == 200


def test_unknown_route_and_method(dense_server: ServerProcess) -> None:
    r = httpx.get(dense_server.url + "/v1/nothing", headers=dense_server.headers, timeout=10)
    assert_error(r, 404)
    r = httpx.get(dense_server.url + "/v1/completions", headers=dense_server.headers, timeout=10)
    assert_error(r, 405)


def test_abort_request_validation(dense_server: ServerProcess) -> None:
    assert_error(post(dense_server, "/abort_request", {}), 400, "rid")
    r = post(dense_server, "/abort_request", {"rid": "cmpl-does-not-exist"})
    assert r.status_code == 200 and r.json() == {"aborted": 0}


def test_health_generate(dense_server: ServerProcess) -> None:
    assert httpx.get(dense_server.url + "/health_generate", timeout=60).status_code == 200


def test_extreme_sampling_values_do_not_break_the_engine(dense_server: ServerProcess) -> None:
    base = {"model": MODEL, "prompt": "edge", "max_tokens": 4, "ignore_eos": True}
    greedy = post(dense_server, "/v1/completions", dict(base, temperature=0)).json()["choices"][0]["text"]
    tiny_t = post(dense_server, "/v1/completions", dict(base, temperature=1e-300))
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["text"] == greedy
    for override in ({"top_p": 1e-300}, {"top_k": 10**9}, {"seed": 2**63 - 1}, {"stop_token_ids": [10**9]}):
        r = post(dense_server, "/v1/completions", dict(base, temperature=1.0, **override))
        assert r.status_code == 200, (override, r.text)
    assert httpx.get(dense_server.url + "/health", timeout=10).status_code == 200
