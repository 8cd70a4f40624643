"""A chat choice's output as the response carries it: the reasoning parser first (thinking → `reasoning_content`),
then the tool-call parser on the answer (function calls → `tool_calls`; with `tool_choice` "required" or a named
function, the constrained answer read as calls instead: api/forced_tool_calls.py), delta by delta. A whole response
is the same parsing fed all at once, so a stream joins to exactly what the non-streamed response holds."""

from __future__ import annotations

from typing import Any

from decode_server.api.forced_tool_calls import ForcedCallCollector, ForcedToolChoice
from decode_server.api.reasoning import ReasoningFormat, ReasoningSplitter
from decode_server.api.tool_calls import ParsedToolCall, ToolCallFormat, ToolCallSplitter


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningFormat | None, template_kwargs: dict[str, Any] | None,
                 tool_format: ToolCallFormat | None, tools: list[dict[str, Any]], max_calls: int | None = None,
                 forced: ForcedToolChoice | None = None) -> None:  # fmt: skip
        self.reasoning = ReasoningSplitter(reasoning, template_kwargs) if reasoning is not None else None
        self.tools = ToolCallSplitter(tool_format, tools, max_calls) if tool_format is not None else None
        self.forced = ForcedCallCollector(forced) if forced is not None else None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None or self.forced is not None

    @property
    def num_calls(self) -> int:
        if self.forced is not None:
            return self.forced.num_calls
        return self.tools.num_calls if self.tools is not None else 0

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model stopped after calling tools (not after a named function's call,
        which OpenAI ends with "stop")."""
        if self.forced is not None and not self.forced.choice.finish_with_tool_calls:
            return reason
        return finish_reason(reason, self.num_calls)

    def feed(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        """(reasoning, answer text, calls) of one delta."""
        thought, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if self.forced is not None:
            return (thought, *self.forced.feed(answer))
        if self.tools is None:
            return thought, answer, []
        answer, calls = self.tools.feed(answer)
        return thought, answer, calls

    def finish(self) -> tuple[str, str, list[ParsedToolCall]]:
        """What was held back at the end of the output."""
        thought, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        if self.forced is not None:
            self.forced.feed(answer)
            return (thought, *self.forced.finish())
        if self.tools is None:
            return thought, answer, []
        answer, calls = self.tools.feed(answer)
        return thought, answer + self.tools.finish(), calls

    def whole(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """(reasoning_content or None, content — None when the answer is calls only —, calls) of a whole output."""
        t1, a1, c1 = self.feed(text)
        t2, a2, c2 = self.finish()
        calls = c1 + c2
        answer = a1 + a2
        return (t1 + t2) or None, (answer if answer or not calls else None), calls


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's "tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if reason == "stop" and num_calls else reason
