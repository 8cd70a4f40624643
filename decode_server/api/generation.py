"""One HTTP request's engine requests (prompts × n choices), submitted together and consumed as one stream.

Each choice is its own engine request with rid `<request id>-<index>`; their deltas share one queue. The
group records the latency metrics (time to first token, inter-token latency, end-to-end) as tokens arrive,
and `abort_unfinished` is what a client disconnect or a cancelled handler calls, so that the engine frees
the memory of every choice still running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from decode_server.api.engine_client import EngineClient, StreamEvent
from decode_server.api.metrics import ServerMetrics
from decode_server.disagg.bootstrap_info import BootstrapInfo
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import TokenLogprob
from decode_server.errors import error_from_name

logger = logging.getLogger(__name__)


@dataclass
class ChoiceSpec:
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt_index: int = 0
    bootstrap: BootstrapInfo | None = None  # PD disaggregation


@dataclass
class ChoiceState:
    """What has been produced so far for one choice."""

    spec: ChoiceSpec
    rid: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with SamplingParams.prompt_logprobs: its first delta
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it, when the engine says
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, found in the engine's prefix cache
    completion_tokens: int = 0
    last_token_time: float | None = None
    counted: bool = False  # its end is in the metrics already


class GenerationGroup:
    def __init__(
        self, client: EngineClient, metrics: ServerMetrics, request_id: str, specs: list[ChoiceSpec]
    ):
        self.client = client
        self.metrics = metrics
        self.request_id = request_id
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.choices = [ChoiceState(spec, f"{request_id}-{spec.index}") for spec in specs]
        for choice in self.choices:
            choice.prompt_tokens = len(choice.spec.prompt_token_ids)
        self.arrival = time.monotonic()
        self._submitted: list[ChoiceState] = []
        self.on_done: Callable[[], object] | None = None  # called once, by the first abort_unfinished

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    async def submit(self) -> None:
        """Submit every choice at once (one engine round trip, not n); if one is refused, abort those accepted
        and re-raise its error."""

        async def submit_one(choice: ChoiceState) -> None:
            spec = choice.spec
            await self.client.submit(choice.rid, spec.prompt_token_ids, spec.params, self.queue, spec.index,
                                     bootstrap=spec.bootstrap)
            self._submitted.append(choice)

        try:
            results = await asyncio.gather(*(submit_one(c) for c in self.choices), return_exceptions=True)
        except BaseException:  # cancelled (client gone) while waiting for the engine
            self.abort_unfinished("request cancelled during submission")
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.abort_unfinished("another choice of the same request was refused")
            raise errors[0]

    async def events(self) -> AsyncIterator[tuple[ChoiceState, StreamEvent]]:
        """Yield each choice's deltas as they arrive (state already updated); raises the error that ends a
        choice (engine death, shutdown). Ends when every choice has finished."""
        by_index = {c.spec.index: c for c in self.choices}
        while not self.done:
            event = await self.queue.get()
            choice = by_index[event.index]
            if event.error is not None:
                choice.finished = True
                self.abort_unfinished(event.error.message)
                raise event.error
            delta = event.delta
            assert delta is not None
            if delta.finished and delta.error_class is not None:  # the engine failed it (e.g. a PD transfer)
                choice.finished = True
                self._count_finished(choice, "abort")
                self.abort_unfinished(delta.error or "request failed")
                raise error_from_name(delta.error_class, delta.error or "request failed")
            self._record(choice, delta.new_token_ids)
            choice.text += delta.text
            choice.token_ids.extend(delta.new_token_ids)
            if delta.logprobs:
                choice.logprobs.extend(delta.logprobs)
            if delta.prompt_logprobs is not None:
                choice.prompt_logprobs = delta.prompt_logprobs
            if delta.prompt_tokens:
                choice.prompt_tokens = delta.prompt_tokens
            if delta.cached_tokens:
                choice.cached_tokens = delta.cached_tokens
            choice.completion_tokens = max(
                choice.completion_tokens, delta.completion_tokens, len(choice.token_ids)
            )
            if delta.finished:
                choice.finished = True
                choice.finish_reason = delta.finish_reason or "stop"
                choice.stop_reason = delta.stop_reason
                self._count_finished(choice, choice.finish_reason)
                if delta.error and delta.finish_reason != "abort":
                    logger.warning("request %s ended with an engine error: %s", choice.rid, delta.error)
            yield choice, event

    def _count_finished(self, choice: ChoiceState, reason: str) -> None:
        if not choice.counted:
            choice.counted = True
            self.metrics.on_finished(reason, time.monotonic() - self.arrival)

    def _record(self, choice: ChoiceState, new_token_ids: list[int]) -> None:
        if not new_token_ids:
            return
        now = time.monotonic()
        if choice.last_token_time is None:
            self.metrics.on_first_token(now - self.arrival)
            self.metrics.on_tokens(len(new_token_ids), None)
        else:
            self.metrics.on_tokens(len(new_token_ids), now - choice.last_token_time)
        choice.last_token_time = now

    def abort_unfinished(self, reason: str) -> int:
        """Abort every submitted choice that has not finished (safe to call from `finally` blocks, and more
        than once). Returns how many were aborted."""
        aborted = 0
        for choice in self._submitted:
            if not choice.finished and self.client.abort_nowait(choice.rid, reason):
                aborted += 1
                self._count_finished(choice, "abort")
        if self.on_done is not None:
            callback, self.on_done = self.on_done, None
            callback()
        return aborted

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens counted once per prompt (OpenAI's usage convention for n > 1)."""
        seen: dict[int, int] = {}
        for c in self.choices:
            seen[c.spec.prompt_index] = c.prompt_tokens
        return sum(seen.values())

    @property
    def cached_tokens(self) -> int:
        """Cached prompt tokens, once per prompt like `prompt_tokens`: what every choice of the prompt reused."""
        seen: dict[int, int] = {}
        for c in self.choices:
            seen[c.spec.prompt_index] = min(seen.get(c.spec.prompt_index, c.cached_tokens), c.cached_tokens)
        return sum(seen.values())

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)
