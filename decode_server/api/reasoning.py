"""Reasoning parsers (SGLang's `--reasoning-parser`): split a reasoning model's output into `reasoning_content` (its
thinking, between `<think>` and `</think>`) and `content` (the answer), in whole responses and in streams.

Which text is reasoning depends on how the model was prompted, so each parser says where an output starts:

- `deepseek-r1`: inside the reasoning (R1's template ends the prompt with `<think>`); a `<think>` the model writes
  again at the very start is dropped.
- `deepseek-v3` (DeepSeek-V3.1 / V3.2): inside the reasoning only when the request turns thinking on
  (`chat_template_kwargs: {"thinking": true}`, which makes the template end the prompt with `<think>`); otherwise
  the whole output is the answer.
- `glm45` (GLM-4.5 / GLM-5): the model opens its reasoning itself: an output that starts (after whitespace) with
  `<think>` is reasoning up to `</think>`, any other output is all answer.

The answer's leading whitespace after `</think>` is dropped (the models write a blank line there). A response cut
before `</think>` (max_tokens) is all reasoning. A stream gives exactly the concatenation of the whole response:
`ReasoningSplitter` holds back text that may be the start of a tag until the next delta tells.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = THINK_START
    end: str = THINK_END
    forced: bool = False  # the output starts inside the reasoning whatever it writes first
    forced_by: str | None = None  # ... only when this chat_template_kwargs key is true

    def starts_in_reasoning(self, template_kwargs: dict[str, Any] | None) -> bool:
        if self.forced_by is not None:
            return bool((template_kwargs or {}).get(self.forced_by))
        return self.forced

    def opens_reasoning(self, template_kwargs: dict[str, Any] | None) -> bool:
        """Whether the model itself may open a reasoning block with `start` (else only a forced start does)."""
        return self.forced_by is None and not self.forced


REASONING_PARSERS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat("deepseek-r1", forced=True),
    "deepseek-v3": ReasoningFormat("deepseek-v3", forced_by="thinking"),
    "glm45": ReasoningFormat("glm45"),
}


def _held_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (text that may become the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningSplitter:
    """One choice's output, fed delta by delta: each `feed` returns (reasoning, content) text ready to send; `finish`
    returns what was held back. Feeding the whole text at once and finishing gives the non-streamed split."""

    def __init__(self, fmt: ReasoningFormat, template_kwargs: dict[str, Any] | None = None) -> None:
        self.fmt = fmt
        if fmt.starts_in_reasoning(template_kwargs):
            self._mode = "reasoning_start"  # inside; a repeated start tag may still come first
        elif fmt.opens_reasoning(template_kwargs):
            self._mode = "undecided"  # the first non-blank text tells
        else:
            self._mode = "content"
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        text = self._held + delta
        self._held = ""
        reasoning, content = [], []
        start, end = self.fmt.start, self.fmt.end
        while text:
            if self._mode in ("undecided", "reasoning_start"):
                stripped = text.lstrip()
                if not stripped or (len(stripped) < len(start) and start.startswith(stripped)):
                    self._held = text  # blank so far, or maybe the start tag
                    break
                if stripped.startswith(start):
                    text = stripped[len(start):]
                    self._mode = "reasoning"
                    continue
                self._mode = "reasoning" if self._mode == "reasoning_start" else "content"
                continue
            if self._mode == "reasoning":
                i = text.find(end)
                if i >= 0:
                    reasoning.append(text[:i])
                    text = text[i + len(end):]
                    self._mode = "answer_start"
                    continue
                keep = _held_prefix_len(text, end)
                reasoning.append(text[: len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            if self._mode == "answer_start":
                text = text.lstrip()
                if text:
                    self._mode = "content"
                continue
            content.append(text)
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What was held back at the end of the output: a tag's beginning that never completed is text again."""
        held, self._held = self._held, ""
        if self._mode == "reasoning" or (self._mode == "reasoning_start" and held.strip()):
            return held, ""
        if self._mode in ("undecided", "content"):
            return "", held
        return "", ""


def split_reasoning(fmt: ReasoningFormat, text: str, template_kwargs: dict[str, Any] | None = None,
                    ) -> tuple[str | None, str]:
    """(reasoning_content, or None when the output has no reasoning text, and content) of a whole output."""
    splitter = ReasoningSplitter(fmt, template_kwargs)
    r1, c1 = splitter.feed(text)
    r2, c2 = splitter.finish()
    return (r1 + r2) or None, c1 + c2
