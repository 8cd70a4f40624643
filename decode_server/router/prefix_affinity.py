"""Which prefill worker last saw the longest start of this prompt: the memory behind the cache_aware policy.

A prefill server with `--enable-prefix-caching` reuses the KV of a prompt's start only if that start was computed
on the same server, so requests that begin alike (a system prompt, a chat's history) should go to the same prefill
worker. The router never sees tokens, only the request's text, so it remembers text: the prompt is cut into blocks
of `BLOCK_CHARS` characters, block i is named by a hash chained over blocks 0..i (so a name stands for the whole
prefix up to it, as a node of the servers' radix tree does), and each name maps to the worker that last got a
prompt starting with that prefix. A lookup walks the chain until the first unknown name: the matched share of the
prompt and the worker that holds it.

Bounded: at most `max_chars / BLOCK_CHARS` names, least recently used dropped first. Each router process keeps its
own (like its other policy state); Python's string hash is per process, which is all a process-local map needs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

BLOCK_CHARS = 64

W = TypeVar("W")


def _block_names(text: str) -> Iterator[int]:
    """Chained hashes of the text's whole blocks (a partial last block names nothing: it is too short to matter)."""
    name = 0
    for start in range(0, len(text) - BLOCK_CHARS + 1, BLOCK_CHARS):
        name = hash((name, text[start:start + BLOCK_CHARS]))
        yield name


class PrefixAffinity(Generic[W]):
    def __init__(self, max_chars: int) -> None:
        self.max_blocks = max(1, max_chars // BLOCK_CHARS)
        self._owner: OrderedDict[int, W] = OrderedDict()
        self._counts: dict[W, int] = {}  # names per worker

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, text: str) -> tuple[W | None, float]:
        """The worker that got the longest remembered start of `text`, and that start's share of the text."""
        owner: W | None = None
        matched = 0
        for name in _block_names(text):
            worker = self._owner.get(name)
            if worker is None:
                break
            owner, matched = worker, matched + BLOCK_CHARS
        return owner, (matched / len(text) if text else 0.0)

    def record(self, text: str, worker: W) -> None:
        """`worker` got this prompt: every prefix of it now points there (most recently used)."""
        for name in _block_names(text):
            previous = self._owner.get(name)
            if previous is not worker:
                if previous is not None:
                    self._counts[previous] -= 1
                self._counts[worker] = self._counts.get(worker, 0) + 1
                self._owner[name] = worker
            self._owner.move_to_end(name)
        while len(self._owner) > self.max_blocks:
            _, dropped = self._owner.popitem(last=False)
            self._counts[dropped] -= 1

    def count_for(self, worker: W) -> int:
        """Blocks remembered for `worker` (a tie-break toward the worker whose cache holds least)."""
        return self._counts.get(worker, 0)


def affinity_text(body: dict[str, Any]) -> str:
    """The text whose start decides the prefill worker: a completion's (first) prompt (/generate: its `text` or
    `input_ids`), or a chat's messages in order. Token-id prompts become their ids as text, which keeps "same
    start" meaning the same."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"<{m.get('role', '')}>{_content_text(m.get('content'))}" for m in messages
                       if isinstance(m, dict))
    prompt = next((body[k] for k in ("prompt", "text", "input_ids") if body.get(k) is not None), None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch goes to one pair: its first prompt decides
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""
