"""`--tool-call-parser` through a real server and the official openai client: the calls a model writes become
`tool_calls` with `finish_reason: "tool_calls"`, streamed as whole calls that join to the non-streamed response;
`tool_choice: "none"` leaves them as text; a conversation with the calls and the tools' answers is rendered by a
`--chat-template` that knows them. The embedded model has random weights, so its output is made to write a call
in GLM's syntax with SGLang's `regex` constraint.

`tool_choice` "required" and a named function constrain the output to the tools' schemas themselves (no parser
needed: the shared server has none): a named function's call ends with "stop", "required"'s with "tool_calls",
streamed calls join to the whole response, an output cut by max_tokens stays text."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import ServerProcess

pytest.importorskip("xgrammar")

MODEL = "tiny-dsa"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
CALL = (r"Let me look\.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>[a-z]{3,6}</arg_value>\n"
        r"<arg_key>days</arg_key>\n<arg_value>[1-9]</arg_value>\n</tool_call>")
MESSAGES = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
# The embedded model's template, plus the tools, the calls of assistant turns and the tools' answers.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ 'Tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}{{ '<tool_call>' + call['function']['name'] }}"
    "{% for key, value in call['function']['arguments'].items() %}"
    "{{ '<arg_key>' + key + '</arg_key><arg_value>' + value | string + '</arg_value>' }}{% endfor %}"
    "{{ '</tool_call>' }}{% endfor %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:
    path = tmp_path_factory.mktemp("tools") / "template.jinja"
    path.write_text(TEMPLATE)
    # Compact JSON (as SGLang's flag): a random model given free whitespace spends max_tokens on it.
    proc = ServerProcess("--tool-call-parser", "glm", "--chat-template", str(path),
                         "--constrained-json-disable-any-whitespace").wait_ready()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


ARGS = {"max_tokens": 180, "temperature": 0.7, "seed": 5, "tools": TOOLS, "extra_body": {"regex": CALL}}


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str, dict[int, tuple[str, dict]], list[str]]:
    content, calls, finishes = "", {}, []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for delta in c.delta.tool_calls or []:
                assert delta.index not in calls, "a call is sent whole, once"
                assert delta.id.startswith("call_") and delta.type == "function"
                calls[delta.index] = (delta.function.name, json.loads(delta.function.arguments))
            if c.finish_reason:
                finishes.append(c.finish_reason)
    return content, calls, finishes


def test_a_written_call_becomes_tool_calls(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **ARGS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content == "Let me look.\n"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert re.fullmatch("[a-z]{3,6}", args["city"]) and isinstance(args["days"], int)  # typed by the schema

    content, calls, finishes = _streamed(client, **ARGS)
    assert content == choice.message.content and finishes == ["tool_calls"]
    assert calls == {0: ("get_weather", args)}


def test_tool_choice_none_leaves_the_call_as_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="none", **ARGS)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"
    assert re.fullmatch(CALL, out.choices[0].message.content)


def test_calls_and_tool_answers_in_the_conversation(client: openai.OpenAI) -> None:
    """The template renders the tools, the earlier call (its arguments as a dict) and the tool's answer."""
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, **ARGS)
    call = out.choices[0].message.tool_calls[0]
    follow_up = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=follow_up, tools=TOOLS, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=4,
                                                temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens  # "Tools: get_weather now"
    assert answer.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10  # the call and the tool's answer


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"tool_choice": "required", "regex": "a+"}, "tool_choice", "cannot be combined"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not one of the tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "no-such-type"}}}}}]}, "tools", "invalid JSON schema"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice", "needs 'tools'"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools", "same function name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "pattern"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "only assistant"),
])
def test_refusals(server: ServerProcess, body: dict, param: str, needle: str) -> None:
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": TOOLS, **body}
    r = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and (error.get("param") or "").startswith(param), error


def test_special_tokens_stay_in_parsed_text(server: ServerProcess, client: openai.OpenAI) -> None:
    """A parser's markers may be special tokens (GLM's <tool_call>): chat requests it reads keep special tokens in
    their text, and any request can ask for them (`skip_special_tokens: false`, SGLang's / vLLM's field)."""
    from decode_server.model import Tokenizer, resolve_model_path

    token = "<｜User｜>"
    token_id = Tokenizer.from_dir(resolve_model_path(MODEL)).token_to_id(token)
    forced = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(token_id): 100}}
    skipped = client.completions.create(model=MODEL, prompt="Hi", **forced)
    kept = client.completions.create(model=MODEL, prompt="Hi", **forced, extra_body={"skip_special_tokens": False})
    assert skipped.choices[0].text == "" and kept.choices[0].text == token * 3
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, **forced)
    assert chat.choices[0].message.content == token * 3
    # ... but the EOS that ends a request is no part of its text, special tokens kept or not
    tokenizer = Tokenizer.from_dir(resolve_model_path(MODEL))
    eos = {"max_tokens": 3, "temperature": 0, "logit_bias": {str(tokenizer.eos_token_id): 100}}
    ended = client.completions.create(model=MODEL, prompt="Hi", **eos, extra_body={"skip_special_tokens": False})
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].text == ""
    assert ended.usage.completion_tokens == 1


# ------------------------------------------------------------------------------------------------ forced calls

# Schemas that leave a random model little room: an enum, a bounded integer, an empty object.
FORCED_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome", "oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED = {"max_tokens": 120, "temperature": 0.8, "seed": 3, "tools": FORCED_TOOLS}


def _check_weather(args: dict) -> None:
    assert args["city"] in ("paris", "rome", "oslo") and 1 <= args["days"] <= 9 and set(args) == {"city", "days"}


def test_a_named_function_is_called_with_its_schemas_arguments(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice=NAMED, **FORCED)
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None, choice  # as OpenAI ends forced calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    _check_weather(args)
    content, calls, finishes = _streamed(client, tool_choice=NAMED, **FORCED)
    assert (content, calls, finishes) == ("", {0: ("get_weather", args)}, ["stop"])


def test_required_calls_one_or_more_tools(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="required",
                                         parallel_tool_calls=False, **FORCED)
    choice = one.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        _check_weather(args)
    else:
        assert (call.function.name, args) == ("now", {})
    content, calls, finishes = _streamed(client, tool_choice="required", parallel_tool_calls=False, **FORCED)
    assert (content, calls, finishes) == ("", {0: (call.function.name, args)}, ["tool_calls"])
    several = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice="required",
                                             **{**FORCED, "max_tokens": 220})
    calls = several.choices[0].message.tool_calls
    assert several.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
    assert {c.function.name for c in calls} <= {"get_weather", "now"}


def test_a_call_cut_by_max_tokens_stays_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice=NAMED,
                                         **{**FORCED, "max_tokens": 3})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    text = choice.message.content
    assert text and ('{"city": "'.startswith(text) or text.startswith('{"city": "')), text


def test_forced_calls_need_no_parser(dense_server: ServerProcess) -> None:
    """The shared server has no --tool-call-parser: "auto" is refused with a hint, a forced call works."""
    client = openai.OpenAI(base_url=dense_server.url + "/v1", api_key=dense_server.api_key, max_retries=0,
                           timeout=120)
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, tools=FORCED_TOOLS)
    assert "--tool-call-parser" in str(exc.value) and "required" in str(exc.value)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, tool_choice=NAMED, **FORCED)
    _check_weather(json.loads(out.choices[0].message.tool_calls[0].function.arguments))
