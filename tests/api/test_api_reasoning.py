"""`--reasoning-parser` through real servers and the official openai client: the thinking in `reasoning_content`,
the answer in `content`, streamed exactly as whole; `chat_template_kwargs` ({"thinking": true} for DeepSeek-V3.x);
`separate_reasoning: false`; `--chat-template FILE`; refusals are 400s naming their parameter.

The embedded model has random weights, so a glm45 server's output is made to open and close a reasoning block with
SGLang's `regex` constraint (glm45 lets the model open it itself, so a constraint is allowed there); the
deepseek-v3 server's thinking outputs never write `</think>`, so they are all reasoning.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest
from api_server_harness import ServerProcess

pytest.importorskip("xgrammar")

MODEL = "tiny-dsa"
THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,3}"
REGEX = rf"<think>{THOUGHT}</think>\n\nanswer [0-9]{{1,3}}"
MESSAGES = [{"role": "user", "content": "Think, then answer."}]


def _server(*args: str) -> Iterator[ServerProcess]:
    proc = ServerProcess(*args).wait_ready()
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture(scope="module")
def glm45() -> Iterator[ServerProcess]:
    yield from _server("--reasoning-parser", "glm45")


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> Iterator[ServerProcess]:
    """`--chat-template`: the embedded model's template plus a line that only `thinking` renders; a context long
    enough for a prompt that the tokenizer pool's workers render (over 8192 characters)."""
    from decode_server.model.tiny import CHAT_TEMPLATE

    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(CHAT_TEMPLATE.replace("{% if add_generation_prompt %}",
                                          "{% if thinking %}{{ 'deep thought mode on' }}{% endif %}"
                                          "{% if add_generation_prompt %}"))
    yield from _server("--chat-template", str(path), "--context-length", "4096")


@pytest.fixture(scope="module")
def deepseek_v3() -> Iterator[ServerProcess]:
    yield from _server("--reasoning-parser", "deepseek-v3", "--enable-hisparse")


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client: openai.OpenAI, **kwargs) -> tuple[str, str, list[str]]:
    """(reasoning, content, finish reasons) of a streamed chat, joined from its deltas."""
    thought, answer, finishes = "", "", []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs):
        for choice in chunk.choices:
            thought += getattr(choice.delta, "reasoning_content", None) or ""
            answer += choice.delta.content or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return thought, answer, finishes


def test_glm45_splits_thinking_from_the_answer(glm45: ServerProcess) -> None:
    client = _client(glm45)
    args = {"max_tokens": 60, "temperature": 0.8, "seed": 3, "extra_body": {"regex": REGEX}}
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, **args)
    message = whole.choices[0].message
    assert re.fullmatch(THOUGHT, message.reasoning_content), message
    assert re.fullmatch(r"answer [0-9]{1,3}", message.content), message
    thought, answer, finishes = _stream(client, **args)
    assert (thought, answer) == (message.reasoning_content, message.content)
    assert finishes == [whole.choices[0].finish_reason]
    raw = client.chat.completions.create(model=MODEL, messages=MESSAGES, **{
        **args, "extra_body": {"regex": REGEX, "separate_reasoning": False}})
    assert raw.choices[0].message.content == f"<think>{message.reasoning_content}</think>\n\n{message.content}"
    assert getattr(raw.choices[0].message, "reasoning_content", None) is None
    # n > 1: each choice its own split, streamed too
    many = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **args)
    assert all(re.fullmatch(THOUGHT, c.message.reasoning_content) for c in many.choices)


def test_glm45_output_without_a_think_block_is_all_answer(glm45: ServerProcess) -> None:
    out = _client(glm45).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                  extra_body={"regex": "plain [a-z]{3}"})
    message = out.choices[0].message
    assert re.fullmatch("plain [a-z]{3}", message.content)
    body = httpx.post(glm45.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8,
                                              "temperature": 0, "regex": "plain [a-z]{3}"}, timeout=60).json()
    assert "reasoning_content" not in body["choices"][0]["message"]  # absent, not null


def test_deepseek_v3_thinking_follows_the_request(deepseek_v3: ServerProcess) -> None:
    client = _client(deepseek_v3)
    args = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}
    off = client.chat.completions.create(model=MODEL, messages=MESSAGES, **args).choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content  # thinking off: all answer
    thinking = {**args, "extra_body": {"ignore_eos": True, "chat_template_kwargs": {"thinking": True}}}
    on = client.chat.completions.create(model=MODEL, messages=MESSAGES, **thinking).choices[0].message
    # the random model never writes </think>: all of its (greedy, same-prompt) output is reasoning
    assert on.reasoning_content == off.content and on.content == ""
    thought, answer, _ = _stream(client, **thinking)
    assert (thought, answer) == (on.reasoning_content, "")


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"chat_template_kwargs": {"thinking": True}, "regex": "a+"}, "response_format", "cannot follow a reasoning"),
    ({"chat_template_kwargs": {"thinking": True}, "tool_choice": "required",
      "tools": [{"type": "function", "function": {"name": "now"}}]}, "tool_choice", "cannot follow a reasoning"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs", "dictionary"),
])
def test_refusals(deepseek_v3: ServerProcess, body: dict, param: str, needle: str) -> None:
    r = httpx.post(deepseek_v3.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and param in (error.get("param") or ""), error


def _prompt_tokens(server: ServerProcess, content: str, **template_kwargs) -> int:
    out = _client(server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=1, temperature=0,
        extra_body={"chat_template_kwargs": template_kwargs} if template_kwargs else None)
    return out.usage.prompt_tokens


def test_chat_template_file_replaces_the_checkpoints(templated: ServerProcess, glm45: ServerProcess) -> None:
    # 8302 characters: rendered by the tokenizer pool's workers, not on the event loop (over INLINE_MAX_CHARS)
    short, long = "Hello there.", "decode server " * 593
    assert _prompt_tokens(templated, short) == _prompt_tokens(glm45, short)  # same template text without thinking
    for content in (short, long):  # the line only `thinking` renders adds tokens (how many: BPE at the seam)
        added = _prompt_tokens(templated, content, thinking=True) - _prompt_tokens(templated, content)
        assert added >= 5, f"{len(content)} chars: the --chat-template file or chat_template_kwargs was not used"


@pytest.mark.parametrize(("content", "needle"), [(None, "cannot read it"), ("{% if %}", "line 1")])
def test_a_bad_chat_template_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str], content, needle) -> None:
    from decode_server.cli import main

    path = tmp_path / "t.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--chat-template", str(path)])
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_tools_need_a_tool_call_parser(glm45: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "now"}}]
    r = httpx.post(glm45.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "tools": tools}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "--tool-call-parser" in r.json()["error"]["message"]


def test_an_unknown_parser_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    from decode_server.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--reasoning-parser", "qwen9"])
    assert exc.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err
