"""`--log-requests` (SGLang's flag): one log line when a generation request passed validation and one when it
ends, on the `decode_server.requests` logger, for operators tracing what a client sent and got (refusals are
counted in the metrics instead). Off by default: prompts and outputs are user data.

`--log-requests-level` (SGLang's levels): 0 — ids, route, token counts, finish reasons, latency; 1 — plus the
sampling parameters (those not at their defaults); 2 — plus the prompt and output text, each cut to its first
MAX_TEXT_CHARS characters; 3 — the whole texts.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("decode_server.requests")

MAX_TEXT_CHARS = 2048


class RequestLog:
    def __init__(self, level: int, tokenizer: Any) -> None:
        self.level = level
        self.tokenizer = tokenizer

    def _text(self, text: str) -> str:
        if self.level < 3 and len(text) > MAX_TEXT_CHARS:
            text = text[:MAX_TEXT_CHARS] + f"...({len(text) - MAX_TEXT_CHARS} more characters)"
        return repr(text)

    def received(self, group: Any, route: str) -> None:
        """A request's choices were created (`group`: api/generation.GenerationGroup), before submission."""
        prompts: dict[int, list[int]] = {c.spec.prompt_index: c.spec.prompt_token_ids for c in group.choices}
        parts = [f"rid={group.request_id}", f"route={route}", f"choices={len(group.choices)}",
                 f"prompt_tokens={[len(p) for p in prompts.values()]}"]
        if self.level >= 1 and group.choices:
            params = group.choices[0].spec.params.model_dump(exclude_defaults=True, mode="json")
            parts.append(f"sampling_params={params}")
        if self.level >= 2:
            texts = [self._text(self.tokenizer.decode(p, skip_special_tokens=False)) for p in prompts.values()]
            parts.append(f"prompts=[{', '.join(texts)}]")
        logger.info("request received: %s", " ".join(parts))

    def finished(self, group: Any) -> None:
        """The request ended (finished, failed, aborted or disconnected): what each choice produced."""
        reasons = [c.finish_reason if c.finished else "unfinished" for c in group.choices]
        parts = [f"rid={group.request_id}", f"finish_reasons={reasons}",
                 f"completion_tokens={[c.completion_tokens for c in group.choices]}",
                 f"e2e_latency={time.monotonic() - group.arrival:.3f}s"]
        if self.level >= 2:
            parts.append(f"outputs=[{', '.join(self._text(c.text) for c in group.choices)}]")
        logger.info("request finished: %s", " ".join(parts))
