"""One request's state as the engine sees it: tokens, progress, status, sampling state, text."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from decode_server.engine.detokenizer import IncrementalDetokenizer, StopStringChecker
from decode_server.engine.sampling_params import SamplingParams
from decode_server.engine.types import FinishReason, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no memory
    PREFILLING = "prefilling"  # admitted, prompt partly in the KV cache
    RUNNING = "running"  # in the decode batch
    RETRACTED = "retracted"  # KV moved out of the pools into host memory; resumes without recompute
    TRANSFERRING = "transferring"  # PD decode: admitted, its prompt's KV is arriving from a prefill server
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; retraction picks the newest
    generator: torch.Generator | None = None
    sampling_seed: int | None = None  # re-seeds `generator` before each token (engine/sampler.py token_seed)
    grammar: Any = None  # the compiled grammar of `params.structured` (engine/structured_output.py)
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # params.prompt_logprobs: those of prompt tokens 1.. as prefill chunks compute them (sent with the first token)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    row: int = -1  # row in the engine's request tables while it holds memory
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens whose KV was mapped from the prefix cache at admission
    # While waiting: (prefix-cache version, tokens of the prompt cached then), so that admission does not walk the
    # cache for every waiting request at every scheduling pass (a 32K prompt's walk takes ~0.7 ms).
    cached_prefix_probe: tuple[int, int] | None = None
    num_bypassed: int = 0  # later requests admitted while this one waited for memory
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    detokenizer: IncrementalDetokenizer | None = None
    stop_checker: StopStringChecker | None = None
    # PD disaggregation (decode_server/disagg/): the prompt's KV comes from a prefill server instead of a
    # forward pass; or, on a prefill server, the KV outlives the request until its transfer has ended.
    remote_prefill: bool = False
    hold_kv: bool = False
    # Overlap scheduling (engine.py): tokens sampled on the device but not read by the host yet (0 or 1 between
    # steps), and where the newest of them sits in the launched step's token tensor.
    num_pending: int = 0
    future_index: int = -1

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def uses_prefix_cache(self) -> bool:
        """Whether admission maps its prompt's cached prefix: not when the prompt's KV comes from elsewhere (PD), nor
        when its prompt logprobs are asked for (every prompt position must be computed)."""
        return not self.remote_prefill and self.params.prompt_logprobs is None

    @property
    def num_tokens(self) -> int:
        """Tokens known so far, including sampled ones the host has not read yet (overlap scheduling)."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, including sampled ones the host has not read yet."""
        return len(self.output_ids) + self.num_pending

    @property
    def reached_max_tokens(self) -> bool:
        """Its last token is sampled (maybe not read yet): no further step may include it."""
        return self.num_output_tokens >= self.params.max_tokens

    @property
    def max_total_len(self) -> int:
        """Tokens whose KV the request may ever hold: the last sampled token is never fed back."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def token_at(self, position: int) -> int:
        """The token at `position`, known to the host (not a pending one)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def check_token_stop(self, token_id: int) -> bool:
        """Record a finish reason if `token_id` (just appended) ends the request."""
        p = self.params
        if not p.ignore_eos and token_id in self.eos_token_ids:
            self.finish_reason, self.stop_reason = "stop", None
            return True
        if token_id in p.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token_id
            return True
        if len(self.output_ids) >= p.max_tokens:
            self.finish_reason = "length"
            return True
        return False
