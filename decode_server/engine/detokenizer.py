"""Incremental detokenization and stop-string detection, shared by the engine and the API process.

Text is produced by decoding a sliding window of tokens (so multi-token characters and tokenizers that merge
spaces come out right) and only emitted once it no longer ends in an incomplete character. Stop strings are
searched in the accumulated text; text that could still become the start of a stop string is held back so a
client never sees part of a stop string.
"""

from __future__ import annotations

from typing import Protocol

# Tokens decoded before the new ones, so that decoding in pieces matches decoding the whole sequence.
_CONTEXT_TOKENS = 6


class SupportsDecode(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas."""

    def __init__(self, tokenizer: SupportsDecode, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:]) if prompt_ids else []
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            new_text = full_text[len(prefix_text) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return new_text
        return ""

    def flush(self) -> str:
        """Whatever text is left at the end (an incomplete character decodes to the replacement char)."""
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset :])
        self.read_offset = len(self.ids)
        return full_text[len(prefix_text) :]


class StopStringChecker:
    """Accumulates text; reports the first stop string and what may be emitted so far."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None
        # A match must end past this much text: what was added while not `armed` (min_tokens) cannot stop alone.
        self._armed_at = 0

    def add(self, new_text: str, armed: bool = True) -> str:
        """Append text; return what can be shown now. After a match, the text is cut before the stop string.
        `armed=False` (the request has fewer than min_tokens tokens) looks for no match yet; a stop string that
        ends in text added later still stops, as vLLM's and SGLang's do."""
        if self.matched is not None:
            return ""
        search_from = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        if not armed:
            self._armed_at = len(self.text)
        elif self.stop:
            hits = [(i, s) for s in self.stop if (i := self._find(s, search_from)) >= 0]
            if hits:
                cut, self.matched = min(hits)
                self.text = self.text[:cut]
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._held_back())

    def _find(self, stop: str, start: int) -> int:
        """The first occurrence of `stop` from `start` that ends past `_armed_at` (-1: none)."""
        start = max(start, self._armed_at - len(stop) + 1)
        return self.text.find(stop, start)

    def finish(self) -> str:
        """The request ended for another reason: release held-back text."""
        return self._emit(len(self.text))

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
