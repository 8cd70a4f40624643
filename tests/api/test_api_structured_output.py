"""Structured outputs through a real server and the official openai client: OpenAI's response_format json_schema /
json_object, SGLang's regex / ebnf (extra_body), streamed and not, equal to the offline engine; every refusal a 400
naming its parameter; `--grammar-backend none` refuses them all."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import CONTEXT_LENGTH, ServerProcess, assert_clean_exit

from decode_server.engine.llm import LLM
from decode_server.engine.sampling_params import SamplingParams, StructuredOutput

pytest.importorskip("xgrammar")

MODEL = "tiny-dsa"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          # a pattern bounds the string (xgrammar 0.2's minLength / maxLength strings admit raw control characters,
          # mlc-ai/xgrammar#800: docs/engine.md "Structured outputs")
          "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pet": {"enum": ["cat", "dog"]}}}  # fmt: skip
REGEX = r"(yes|no), [0-9]{2,4}!"
EBNF = 'root ::= "<" item ("," item)* ">"\nitem ::= [a-c] | "zz"'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # HiSparse, JSON without optional whitespace (bounded: the random model finishes it)
    proc = ServerProcess("--enable-hisparse", "--constrained-json-disable-any-whitespace").wait_ready()
    try:
        yield proc
    finally:
        try:
            assert_clean_exit(proc, proc.stop(signal.SIGTERM))
        finally:
            proc.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(MODEL, device="cpu", context_length=CONTEXT_LENGTH, constrained_json_disable_any_whitespace=True)


def test_json_schema_chat_equals_offline(client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    assert set(value) == {"name", "age", "pet"} and re.fullmatch("[a-z]{1,6}", value["name"])
    assert 0 <= value["age"] <= 120
    assert value["pet"] in ("cat", "dog")
    prompt = offline.tokenizer.encode(offline.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    params = SamplingParams(max_tokens=80, temperature=0,
                            structured=StructuredOutput(kind="json_schema", spec=json.dumps(SCHEMA)))
    assert offline.generate([prompt], params)[0].text == choice.message.content


def test_regex_and_ebnf_completions_streamed_and_not(client: openai.OpenAI) -> None:
    for seed in range(3):
        out = client.completions.create(model=MODEL, prompt=f"Answer {seed}:", max_tokens=20, temperature=0.9,
                                        seed=seed, extra_body={"regex": REGEX})
        assert out.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, out.choices[0].text), out.choices[0]
    chunks = list(client.completions.create(model=MODEL, prompt="List:", max_tokens=40, temperature=0.7, seed=5,
                                            stream=True, extra_body={"ebnf": EBNF}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(r"<(?:[a-c]|zz)(?:,(?:[a-c]|zz))*>", text), text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_object_is_a_json_object_prefix(client: openai.OpenAI) -> None:
    """Any JSON object: the random model may not close it within max_tokens; what it wrote starts one, and a
    finished answer parses."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=30, temperature=0, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                        "properties": 3}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"regex": "(unclosed"}, "regex", "invalid regex"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf", "invalid EBNF"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "one output constraint"),
    ({"regex": "a+", "min_tokens": 2}, "min_tokens", "cannot be combined"),
]


@pytest.mark.parametrize(("override", "param", "contains"), BAD)
def test_bad_constraints_are_400(server: ServerProcess, override: dict, param: str, contains: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **override}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and contains in err["message"], err
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_grammar_backend_none_refuses_constraints() -> None:
    proc = ServerProcess("--grammar-backend", "none").wait_ready()
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "response_format": {"type": "json_object"}}
        r = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--grammar-backend none" in r.json()["error"]["message"], r.text
        ok = httpx.post(proc.url + "/v1/completions", json={**body, "response_format": {"type": "text"}}, timeout=60)
        assert ok.status_code == 200, ok.text
    finally:
        proc.kill()
