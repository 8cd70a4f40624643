"""Tool-call parsers (SGLang's `--tool-call-parser`): find the function calls a model wrote in its answer and turn
them into OpenAI `tool_calls`, in whole responses and in streams.

Formats of the DSA model families:

- `deepseekv32` (DeepSeek-V3.2's DSML; its release describes the format with a Python encoder, so serve it with a
  `--chat-template` that renders `tools`):
      <｜DSML｜function_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜function_calls>
  A parameter with `string="true"` is its text; with `string="false"` it is JSON (numbers, booleans, arrays,
  objects) where it parses; the blank space around a value is dropped. As SGLang reads it, the tags may also come
  without their `｜DSML｜` marker, and an invoke may hold its arguments as one JSON object instead of parameters.
- `glm` (GLM-4.5 and later; `glm45` and `glm47` are the same): GLM-4.5 / 4.6 write
      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>
  and GLM-4.7 / GLM-5 the same without the newlines
  (`<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>`).
  A value is the text as written where the tool's schema says the parameter is a string, else JSON when it parses
  as JSON (else the text).

Text before the first call is `content`; the calls follow. A call is emitted once its block has closed (in a stream:
one `tool_calls` delta with the whole call); a block naming no requested tool, one that does not parse, or one left
open when the output ends stays in `content` as written. `ToolCallSplitter` holds back text that may be the start of
a block until the next delta tells, so a stream gives exactly the whole response's result.
"""

from __future__ import annotations

import json
import re
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    id: str


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _schema_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name → {parameter name: its JSON-schema type (or None)} of the request's tools."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool)
        props = ((fn.get("parameters") or {}).get("properties") or {})
        out[fn["name"]] = {k: (v or {}).get("type") for k, v in props.items()}
    return out


class ToolCallFormat(ABC):
    """One model family's call syntax: where a block starts and ends, and how to read one closed block."""

    name: str
    starts: tuple[str, ...]  # texts that open a block
    ends: tuple[str, ...]  # the text that closes the block opened by starts[i]

    @abstractmethod
    def parse(self, block: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]] | None:
        """The (function name, arguments) of a closed block, or None when it is no valid call of a requested tool
        (the block then stays text)."""


class DeepSeekV32Format(ToolCallFormat):
    name = "deepseekv32"
    # One block a function_calls section, holding one invoke a call; the tags also come without their DSML marker.
    starts = ("<｜DSML｜function_calls>", "<function_calls>")
    ends = ("</｜DSML｜function_calls>", "</function_calls>")
    _section = re.compile(r"^<(?:｜DSML｜)?function_calls>(.*)</(?:｜DSML｜)?function_calls>$", re.S)
    _invoke = re.compile(r'<(?:｜DSML｜)?invoke\s+name="([^"]+)"\s*>(.*?)</(?:｜DSML｜)?invoke>', re.S)
    _param = re.compile(r'<(?:｜DSML｜)?parameter\s+name="([^"]+)"(?:\s+string="(true|false)")?\s*>(.*?)'
                        r'</(?:｜DSML｜)?parameter>', re.S)

    def parse(self, block: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]] | None:
        section = self._section.match(block)
        if section is None or self._invoke.sub("", section.group(1)).strip():
            return None  # text in the section that is no invoke
        calls = []
        for name, body in self._invoke.findall(section.group(1)):
            if name not in schemas:
                return None
            args = self._arguments(body)
            if args is None:
                return None
            calls.append((name, args))
        return calls or None

    def _arguments(self, body: str) -> dict[str, Any] | None:
        """Parameter tags (a value's surrounding blank space dropped; `string="false"`: JSON when it parses), or
        the arguments as one JSON object."""
        stripped = body.strip()
        if stripped.startswith("{"):
            try:
                args = json.loads(stripped)
            except ValueError:
                return None
            return args if isinstance(args, dict) else None
        if self._param.sub("", body).strip():
            return None  # text in the invoke that is no parameter
        args = {}
        for key, is_string, value in self._param.findall(body):
            value = value.strip()
            if is_string == "false":
                try:
                    args[key] = json.loads(value)
                    continue
                except ValueError:
                    pass
            args[key] = value
        return args


class GLMFormat(ToolCallFormat):
    name = "glm"
    starts = ("<tool_call>",)
    ends = ("</tool_call>",)
    _call = re.compile(r"^<tool_call>([^<\n]+?)\s*((?:<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>\s*)*)"
                       r"</tool_call>$", re.S)
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, block: str, schemas: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]] | None:
        match = self._call.match(block)
        if match is None:
            return None
        name = match.group(1).strip()
        if name not in schemas:
            return None
        types = schemas[name]
        args: dict[str, Any] = {}
        for key, value in self._pair.findall(match.group(2)):
            key = key.strip()
            if types.get(key) == "string":
                args[key] = value
                continue
            try:
                args[key] = json.loads(value)
            except ValueError:
                args[key] = value
        return [(name, args)]


# SGLang names GLM's parser glm45 (GLM-4.5 / 4.6, a newline after the name and each tag) and glm47 (GLM-4.7, GLM-5:
# none); this one reads both.
TOOL_CALL_PARSERS: dict[str, ToolCallFormat] = {"deepseekv32": DeepSeekV32Format(), "glm": GLMFormat(),
                                                "glm45": GLMFormat(), "glm47": GLMFormat()}


def _held_prefix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(text), len(tag) - 1), best, -1):
            if tag.startswith(text[-n:]):
                best = n
                break
    return best


class ToolCallSplitter:
    """One choice's answer text, fed delta by delta: `feed` returns (content, calls) ready to send, `finish` what
    was held back. Feeding the whole answer at once and finishing gives the non-streamed result. Blank text after a
    call is held until other text follows (then sent with it) and dropped at the end: the space between and after
    calls is layout, not an answer."""

    def __init__(self, fmt: ToolCallFormat, tools: list[dict[str, Any]], max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.schemas = _schema_types(tools)
        self.max_calls = max_calls  # `parallel_tool_calls: false`: 1 (calls past it are dropped)
        self._held = ""  # text that may start a block, or an open block
        self._blank = ""  # blank text after a call
        self._block_end: str | None = None  # inside a block: the text that closes it
        self.num_calls = 0

    def _content(self, out: list[str], text: str) -> None:
        if not text:
            return
        if self.num_calls and not text.strip():
            self._blank += text
            return
        out.append(self._blank + text)
        self._blank = ""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        text = self._held + delta
        self._held = ""
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while text:
            if self._block_end is not None:
                i = text.find(self._block_end)
                if i < 0:
                    self._held = text  # the block so far
                    break
                block, text = text[: i + len(self._block_end)], text[i + len(self._block_end):]
                self._block_end = None
                parsed = self.fmt.parse(block, self.schemas)
                if parsed is None:
                    self._content(content, block)
                    continue
                if self.max_calls is not None:
                    parsed = parsed[: max(0, self.max_calls - self.num_calls)]
                calls += [ParsedToolCall(name, json.dumps(args, ensure_ascii=False), new_call_id())
                          for name, args in parsed]
                self.num_calls += len(parsed)
                continue
            found = [(text.find(tag), k) for k, tag in enumerate(self.fmt.starts) if tag in text]
            if found:
                i, k = min(found)
                self._content(content, text[:i])
                text = text[i:]
                self._block_end = self.fmt.ends[k]
                continue
            keep = _held_prefix_len(text, self.fmt.starts)
            self._content(content, text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(content), calls

    def finish(self) -> str:
        """What was held back at the end: an unclosed block, or a start that never completed, is text again; blank
        text after the last call is dropped."""
        held, self._held = self._held, ""
        self._block_end = None
        out: list[str] = []
        self._content(out, held)
        self._blank = ""
        return "".join(out)


def split_tool_calls(fmt: ToolCallFormat, text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ParsedToolCall]]:
    """(content, calls) of a whole answer."""
    splitter = ToolCallSplitter(fmt, tools)
    content, calls = splitter.feed(text)
    return content + splitter.finish(), calls
