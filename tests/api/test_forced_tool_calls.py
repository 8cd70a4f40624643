"""`tool_choice` "required" / a named function without a server (decode_server/api/forced_tool_calls.py): the JSON
schema each asks the output to match, the refusals, and how a constrained output becomes calls — streamed in any
chunking, it gives exactly the whole response's calls, content and finish reason."""

from __future__ import annotations

import json
import random

import pytest

from decode_server.api.chat_output import ChatOutputParser
from decode_server.api.forced_tool_calls import ForcedToolChoice, forced_calls, forced_tool_choice
from decode_server.errors import InvalidRequestError

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]  # no parameters: any object
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def test_auto_and_none_constrain_nothing() -> None:
    assert forced_tool_choice("auto", TOOLS, None) is None
    assert forced_tool_choice("none", TOOLS, None) is None


def test_a_named_function_constrains_the_output_to_its_parameters() -> None:
    choice = forced_tool_choice(NAMED, TOOLS, None)
    assert choice == ForcedToolChoice("get_weather", WEATHER)
    assert not choice.finish_with_tool_calls  # OpenAI ends a forced function's response with "stop"
    assert forced_tool_choice({"type": "function", "function": {"name": "now"}}, TOOLS, None).schema == {
        "type": "object"}


def test_required_is_an_array_of_named_calls_each_with_its_tools_schema() -> None:
    choice = forced_tool_choice("required", TOOLS, None)
    assert choice.name is None and choice.finish_with_tool_calls
    schema = choice.schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    cases = schema["items"]["anyOf"]
    assert [c["properties"]["name"] for c in cases] == [{"type": "string", "enum": ["get_weather"]},
                                                        {"type": "string", "enum": ["now"]}]
    assert [c["properties"]["parameters"] for c in cases] == [WEATHER, {"type": "object"}]
    assert all(c["required"] == ["name", "parameters"] and c["additionalProperties"] is False for c in cases)
    one = forced_tool_choice("required", TOOLS[:1], False).schema
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"]["enum"] == ["get_weather"]  # no anyOf


@pytest.mark.parametrize(("tool_choice", "needle"), [
    ({"type": "function", "function": {"name": "missing"}}, "not one of the tools"),
    ({"type": "function"}, "must be"),
    ({"type": "function", "function": "get_weather"}, "must be"),
    ({"type": "tool", "function": {"name": "get_weather"}}, "must be"),
    ({"type": "function", "function": {"name": 3}}, "must be"),
])
def test_refusals_name_tool_choice(tool_choice: dict, needle: str) -> None:
    with pytest.raises(InvalidRequestError) as exc:
        forced_tool_choice(tool_choice, TOOLS, None)
    assert needle in exc.value.message and exc.value.param == "tool_choice"


def test_outputs_become_calls_or_stay_text() -> None:
    named = forced_tool_choice(NAMED, TOOLS, None)
    (call,) = forced_calls(named, '{"city": "Zürich", "days": 2}')
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Zürich", "days": 2}
    assert "Zürich" in call.arguments and call.id.startswith("call_")  # non-ASCII kept as written
    assert forced_calls(named, '{"city": "Zü') is None  # cut by max_tokens
    assert forced_calls(named, "[1]") is None
    required = forced_tool_choice("required", TOOLS, None)
    calls = forced_calls(required, '[{"name": "now", "parameters": {}}, '
                                   '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("now", {}), ("get_weather", {"city": "Oslo"})]
    assert len({c.id for c in calls}) == 2
    for text in ("[]", '{"name": "now"}', '[{"name": "now"}]', '[{"name": 1, "parameters": {}}]', "[{"):
        assert forced_calls(required, text) is None, text


def _stream(parser: ChatOutputParser, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    bounds = [0, *cuts, len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        _, answer, got = parser.feed(text[a:b])
        content += answer
        calls += [(c.name, c.arguments) for c in got]
    _, answer, got = parser.finish()
    return content + answer, calls + [(c.name, c.arguments) for c in got]


@pytest.mark.parametrize(("tool_choice", "text", "reason", "expected_reason", "expected_calls"), [
    (NAMED, '{"city": "Paris", "days": 3}', "stop", "stop", [("get_weather", '{"city": "Paris", "days": 3}')]),
    ("required", '[{"name": "now", "parameters": {}}]', "stop", "tool_calls", [("now", "{}")]),
    ("required", '[{"name": "now", "para', "length", "length", []),
    (NAMED, '{"city": "Par', "length", "length", []),
])
def test_streamed_in_any_chunking_equals_whole(tool_choice, text: str, reason: str, expected_reason: str,
                                               expected_calls: list) -> None:  # fmt: skip
    forced = forced_tool_choice(tool_choice, TOOLS, None)

    def parser() -> ChatOutputParser:
        return ChatOutputParser(None, None, None, TOOLS, forced=forced)

    whole = parser()
    thought, content, calls = whole.whole(text)
    assert thought is None
    assert [(c.name, c.arguments) for c in calls] == expected_calls
    assert content == (None if expected_calls else text)
    assert whole.finish_reason(reason) == expected_reason
    rng = random.Random(0)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(6, len(text) - 1))))
        streamed = parser()
        got_content, got_calls = _stream(streamed, text, cuts)
        assert (got_content or None, got_calls) == (content, expected_calls), cuts
        assert streamed.num_calls == len(expected_calls) and streamed.finish_reason(reason) == expected_reason
