"""`tool_choice` "required" and a named function: the model must call a tool, so its output is constrained (a JSON
schema, compiled by the structured-output backend) instead of parsed from the model's own call syntax.

As vLLM and SGLang do it:

- a named function (`{"type": "function", "function": {"name": "f"}}`): the output is f's arguments, a JSON object
  of f's `parameters` schema; the response carries one call of f with them. OpenAI ends such a response with
  `finish_reason: "stop"`, not "tool_calls"; so does this server.
- "required": the output is a JSON array of at least one `{"name": ..., "parameters": {...}}`, each name one of the
  request's tools with that tool's schema (at most one element with `parallel_tool_calls: false`); each element
  becomes a call, and a response that stopped after them ends with `finish_reason: "tool_calls"`.

So no `--tool-call-parser` is needed for these two, only the tools rendered into the prompt by the chat template
and a structured-output backend. An output cut by max_tokens is not a call: its text stays `content`. Calls are
sent when the output ends (in a stream: one delta with the whole calls), as the auto parsers send theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from decode_server.api.tool_calls import ParsedToolCall, new_call_id
from decode_server.errors import InvalidRequestError

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ForcedToolChoice:
    name: str | None  # the named function; None: "required" (any of the tools)
    schema: dict[str, Any]  # what the output must match

    @property
    def finish_with_tool_calls(self) -> bool:
        """OpenAI's finish reason after the calls: "tool_calls" for "required", "stop" for a named function."""
        return self.name is None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or ANY_OBJECT


def forced_tool_choice(tool_choice: str | dict[str, Any], tools: list[dict[str, Any]],
                       parallel_tool_calls: bool | None) -> ForcedToolChoice | None:  # fmt: skip
    """The constraint `tool_choice` asks for (None for "auto" / "none"); a 400 naming `tool_choice` for a choice
    that is not OpenAI's shape or names no requested tool. `tools`: the request's tools as dicts."""
    if tool_choice in ("auto", "none"):
        return None
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                   "parameters": _parameters(t)},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": items[0] if len(items) == 1 else {"anyOf": items}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ForcedToolChoice(None, schema)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                  '{"type": "function", "function": {"name": ...}}', param="tool_choice")
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise InvalidRequestError(f"'tool_choice' names the function {name!r}, which is not one of the tools",
                                  param="tool_choice")
    return ForcedToolChoice(name, _parameters(tool))


def forced_calls(choice: ForcedToolChoice, text: str) -> list[ParsedToolCall] | None:
    """The calls of a whole constrained output, or None when it does not parse (cut by max_tokens, stopped by a
    stop string): then the text is the response's content."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if choice.name is not None:
        if not isinstance(value, dict):
            return None
        return [ParsedToolCall(choice.name, json.dumps(value, ensure_ascii=False), new_call_id())]
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, dict) and isinstance(v.get("name"), str) and isinstance(v.get("parameters"), dict)
               for v in value):
        return None
    return [ParsedToolCall(v["name"], json.dumps(v["parameters"], ensure_ascii=False), new_call_id()) for v in value]


class ForcedCallCollector:
    """One choice's constrained answer, fed delta by delta: nothing is sent until the end, then the calls (or, when
    the output does not parse, the text as content)."""

    def __init__(self, choice: ForcedToolChoice) -> None:
        self.choice = choice
        self._text: list[str] = []
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        self._text.append(delta)
        return "", []

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        text = "".join(self._text)
        self._text = []
        calls = forced_calls(self.choice, text)
        if calls is None:
            return text, []
        self.num_calls += len(calls)
        return "", calls
