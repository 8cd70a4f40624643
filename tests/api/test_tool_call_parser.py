"""The tool-call parsers (decode_server/api/tool_calls.py) and the chat output pipeline (decode_server/api/
chat_output.py) on their own: each format's calls and arguments, text around them, malformed or unknown calls left
as text, and a stream cut anywhere gives exactly the whole output's result."""

from __future__ import annotations

import json
import random

import pytest

from decode_server.api.chat_output import ChatOutputParser, finish_reason
from decode_server.api.reasoning import REASONING_PARSERS
from decode_server.api.tool_calls import TOOL_CALL_PARSERS, ToolCallSplitter, split_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "string"},
        "spots": {"type": "array"}}}}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]
DSV32, GLM = TOOL_CALL_PARSERS["deepseekv32"], TOOL_CALL_PARSERS["glm"]
D = "｜DSML｜"


def dsml(*invokes: str, bar: str = D) -> str:
    return f"<{bar}function_calls>\n" + "".join(invokes) + f"</{bar}function_calls>"


def invoke(name: str, *params: tuple[str, str, bool], bar: str = D) -> str:
    body = "".join(f'<{bar}parameter name="{k}" string="{"true" if s else "false"}">{v}</{bar}parameter>\n'
                   for k, v, s in params)
    return f'<{bar}invoke name="{name}">\n{body}</{bar}invoke>\n'


def glm(name: str, *pairs: tuple[str, str]) -> str:
    return f"<tool_call>{name}\n" + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                             for k, v in pairs) + "</tool_call>"


WEATHER = invoke("get_weather", ("city", "Paris", True), ("days", "3", False), ("spots", '["a", "b"]', False))
CASES = [  # (format, output, content, [(name, arguments)])
    (DSV32, "Let me check.\n\n" + dsml(WEATHER) + "\n", "Let me check.\n\n",
     [("get_weather", {"city": "Paris", "days": 3, "spots": ["a", "b"]})]),
    (DSV32, dsml(WEATHER, invoke("now")), "", [("get_weather", {"city": "Paris", "days": 3, "spots": ["a", "b"]}),
                                               ("now", {})]),
    (DSV32, dsml(invoke("get_weather", ("city", "Nice", True), bar=""), bar=""), "",
     [("get_weather", {"city": "Nice"})]),  # tags without their DSML marker
    (DSV32, dsml(f'<{D}invoke name="get_weather">\n{{"city": "Rome", "days": 2}}\n</{D}invoke>\n'), "",
     [("get_weather", {"city": "Rome", "days": 2})]),  # arguments as one JSON object
    (DSV32, dsml(invoke("delete_everything")), dsml(invoke("delete_everything")), []),  # not a requested tool
    (DSV32, dsml(invoke("get_weather", ("days", "three", False))), "",
     [("get_weather", {"days": "three"})]),  # string="false" that is no JSON: its text
    (DSV32, dsml(f'<{D}invoke name="get_weather">\nstray text\n</{D}invoke>\n'),
     dsml(f'<{D}invoke name="get_weather">\nstray text\n</{D}invoke>\n'), []),  # neither parameters nor JSON
    (DSV32, "No call. " + dsml(WEATHER)[:40], "No call. " + dsml(WEATHER)[:40], []),  # cut before it closed
    (DSV32, "plain answer", "plain answer", []),
    (GLM, glm("get_weather", ("city", "42"), ("days", "3")), "", [("get_weather", {"city": "42", "days": 3})]),
    (GLM, "Sure.\n" + glm("now") + "\n" + glm("get_weather", ("units", "C")) + "\n\n", "Sure.\n",
     [("now", {}), ("get_weather", {"units": "C"})]),
    (GLM, glm("now") + " and then some text", " and then some text", [("now", {})]),
    (GLM, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key>"
          "<arg_value>2</arg_value></tool_call><tool_call>now</tool_call>", "",
     [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]),  # GLM-4.7 / GLM-5: no newlines
    (GLM, glm("unknown_fn"), glm("unknown_fn"), []),
    (GLM, "<tool_ca", "<tool_ca", []),
    (GLM, "<tool_call>now\n", "<tool_call>now\n", []),
]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_whole_output(fmt, text, content, calls) -> None:
    got_content, got_calls = split_tool_calls(fmt, text, TOOLS)
    assert (got_content, calls_of(got_calls)) == (content, calls)
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)


def _streamed(fmt, pieces: list[str]) -> tuple[str, list]:
    splitter = ToolCallSplitter(fmt, TOOLS)
    content, calls = "", []
    for piece in pieces:
        c, k = splitter.feed(piece)
        content, calls = content + c, calls + k
    return content + splitter.finish(), calls_of(calls)


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_stream_cut_anywhere_equals_the_whole(fmt, text, content, calls) -> None:
    for cut in range(len(text) + 1):
        assert _streamed(fmt, [text[:cut], text[cut:]]) == (content, calls), cut
    rng = random.Random(len(text))
    for _ in range(30):
        pieces, rest = [], text
        while rest:
            n = rng.randint(1, 6)
            pieces.append(rest[:n])
            rest = rest[n:]
        assert _streamed(fmt, pieces) == (content, calls)


def test_reasoning_then_calls_and_the_finish_reason() -> None:
    """DeepSeek-V3.2 thinking: the thinking, then an answer with a call; streamed as whole."""
    text = "I need the weather.</think>\n\nChecking.\n" + dsml(WEATHER)
    parser = ChatOutputParser(REASONING_PARSERS["deepseek-v3"], {"thinking": True}, DSV32, TOOLS)
    thought, answer, calls = parser.whole(text)
    assert (thought, answer) == ("I need the weather.", "Checking.\n") and calls_of(calls)[0][0] == "get_weather"
    streamed = ChatOutputParser(REASONING_PARSERS["deepseek-v3"], {"thinking": True}, DSV32, TOOLS)
    t, a, k = "", "", []
    for i in range(0, len(text), 3):
        dt, da, dk = streamed.feed(text[i:i + 3])
        t, a, k = t + dt, a + da, k + dk
    dt, da, dk = streamed.finish()
    assert (t + dt, a + da, calls_of(k + dk)) == (thought, answer, calls_of(calls))
    only_calls = ChatOutputParser(None, None, GLM, TOOLS).whole(glm("now"))
    assert only_calls[1] is None  # OpenAI's null content when the answer is calls only
    assert finish_reason("stop", 1) == "tool_calls" and finish_reason("length", 1) == "length"
    assert finish_reason("stop", 0) == "stop"


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = "Sure.\n" + glm("now") + "\n" + glm("get_weather", ("units", "C")) + "\n"
    content, calls = split_tool_calls(GLM, text, TOOLS)
    assert len(calls) == 2
    one = ToolCallSplitter(GLM, TOOLS, max_calls=1)
    c1, k1 = one.feed(text)
    assert (c1 + one.finish(), calls_of(k1)) == ("Sure.\n", [("now", {})])  # the second block is dropped


def test_chat_chars_count_calls_and_tools() -> None:
    """What a template renders besides the messages' text (calls of earlier turns, the tools) counts toward the
    prompt's size bound and the choice of rendering in a tokenizer worker."""
    from decode_server.api.tokenization import chat_chars

    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {"x": "y" * 100}}}]}]
    assert chat_chars(messages[:1]) == 2
    assert chat_chars(messages) > 100
    assert chat_chars(messages[:1], {"tools": TOOLS}) > len("get_weather") + 2
