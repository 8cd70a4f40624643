"""Continuous-batching scheduler: waiting queue → admission → chunked prefill → decode set, with retraction.

Each call to `schedule()` picks one forward pass:
1. resume retracted requests (oldest first) when memory allows; while any remain, new requests wait;
2. admit waiting requests while a request row is free and the KV budget allows, estimating how much the running
   requests will still grow (SGLang's new-token ratio, below) instead of reserving their worst case; a request
   that does not fit now does not block smaller ones behind it (it keeps its turn: after `HOL_BYPASS_LIMIT`
   later requests went ahead of it, nobody else is admitted before it);
3. if some admitted request still has prompt left, a prefill batch of prompt chunks under the token budget
   (`chunked_prefill_size`), so new requests join the decode batch quickly — but never two prefill passes in a
   row while requests are decoding: prefill and decode alternate, so a long prompt delays each running request
   by at most one chunk per token;
4. otherwise one decode step for every running request. Before it, each request gets room for its next token;
   when memory runs out, the newest running requests are retracted until the rest fit.

New-token ratio: a request that may generate `m` more tokens is expected to need `ratio × min(m, CLIP)` more
tokens of KV. The ratio starts at `INIT_NEW_TOKEN_RATIO`, decays linearly by decode step to
`MIN_NEW_TOKEN_RATIO_FACTOR × INIT_NEW_TOKEN_RATIO` (most requests stop long before max_tokens), and after a
retraction is raised to what the running batch actually used: (decoded tokens + `RETRACT_DECODE_STEPS` per
request) / (their max_tokens), so admission becomes more careful exactly when the estimate proved too low.

Prefix caching (`KVManager.enable_prefix_cache`): a request admitted with its prompt's first tokens cached starts
its prefill after them (`num_computed`), admission counts only the pages it still needs, and a request that ends
hands the tokens whose KV its pages hold to the KV manager, which keeps the full pages for later prompts.

Priority scheduling (`priority_first`: SGLang's --enable-priority-scheduling): requests are ordered by their
`priority` (larger first, or smaller first with --schedule-low-priority-values-first), then by arrival, instead of
by arrival alone — the waiting queue (admission), the retracted requests (resumption) and the running ones (the
lowest-priority, newest is retracted first). A running request is not preempted for a waiting one of higher
priority: it ends, or is retracted when memory runs out, as without priorities.

PD disaggregation (decode_server/disagg/) adds two holding sets: `transferring` (decode: admitted like any
request, but its prompt's KV arrives from a prefill server instead of being computed; it joins the decode set
with `commit_transferred`) and `held` (prefill: finished requests whose KV rows stay allocated until their
transfer has ended; `release_held` frees them).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from decode_server.engine.kv_manager import KVManager
from decode_server.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)

# SGLang's defaults (python/sglang/srt/managers/scheduler.py, schedule_policy.py).
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096  # future growth counted per request, at most (SGLang's CLIP_MAX_NEW_TOKENS_ESTIMATION)
# Later requests that may be admitted ahead of a waiting request that does not fit, before it blocks the queue.
HOL_BYPASS_LIMIT = 64


@dataclass
class ScheduledBatch:
    """One forward pass: per request, how many tokens after its cached prefix; and who gets a token sampled."""

    requests: list[Request]
    prefix_lens: list[int]
    extend_lens: list[int]
    is_decode: bool

    @property
    def sampled(self) -> list[bool]:
        """A request is sampled when this pass covers all of its known tokens (the prompt's last chunk)."""
        return [p + e == r.num_tokens for r, p, e in zip(self.requests, self.prefix_lens, self.extend_lens,
                                                         strict=True)]


class Scheduler:
    def __init__(
        self, kv: KVManager, max_running_requests: int, chunked_prefill_size: int, fixed_prefill_chunks: bool = False,
        priority_first: str | None = None,
    ) -> None:
        """`priority_first`: None (arrival order), "high" or "low" (priority scheduling: which values go first)."""
        self.kv = kv
        self._priority_sign = {None: 0, "high": -1, "low": 1}[priority_first]
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        # Deterministic inference: a prompt is always cut at multiples of chunked_prefill_size of its own tokens,
        # whatever else is prefilling (chunk boundaries change the indexer's GEMM shapes, hence its rounding).
        self.fixed_prefill_chunks = fixed_prefill_chunks
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.retracted: list[Request] = []
        self.transferring: list[Request] = []
        self.held: dict[str, Request] = {}
        self.newly_transferring: list[Request] = []  # admitted since the PD role last looked
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        # Overlap scheduling: the rows of the step launched but not yet finished on the device (tagged with its
        # step id). A row freed while that step may still touch it is released only once it has finished.
        self.inflight_rows: frozenset[int] = frozenset()
        self.inflight_step = 0
        self._deferred_rows: list[tuple[int, int, list[int] | None]] = []  # (step id, row, tokens to cache)
        self.num_retractions = 0
        self._last_was_prefill = False
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # How much of its own (clipped) max_tokens a new request must find room for: SGLang asks for all of it.
        self.new_request_ratio = 1.0
        self.min_new_token_ratio = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
        self.new_token_ratio_decay = (INIT_NEW_TOKEN_RATIO - self.min_new_token_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS

    # -- bookkeeping --
    @property
    def num_holding_rows(self) -> int:
        return len(self.prefilling) + len(self.running) + len(self.retracted) + len(self.transferring) + len(
            self.held)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.retracted or self.transferring
                    or self.held or self._deferred_rows)

    def order(self, req: Request) -> tuple[int, int]:
        """Who goes first: the smaller key (arrival alone without priority scheduling)."""
        return self._priority_sign * req.params.priority, req.arrival

    def add(self, req: Request) -> None:
        if self._priority_sign:
            key = self.order(req)
            i = next((i for i, other in enumerate(self.waiting) if self.order(other) > key), len(self.waiting))
            self.waiting.insert(i, req)
        else:
            self.waiting.append(req)

    def remove(self, req: Request, hold: bool = False) -> None:
        """Take a request out of whichever set holds it and give back its memory (finish or abort).

        `hold`: keep its request row and KV allocated (in `held`) until `release_held`, e.g. while a PD transfer
        may still read or write them."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            for group in (self.prefilling, self.running, self.retracted, self.transferring):
                if req in group:
                    group.remove(req)
                    break
            if req in self.newly_transferring:
                self.newly_transferring.remove(req)
            if req.row >= 0 and hold:
                self.held[req.rid] = req
            elif req.row >= 0:
                self._free_row(req)
        req.status = RequestStatus.FINISHED

    def release_held(self, rid: str) -> bool:
        req = self.held.pop(rid, None)
        if req is None:
            return False
        self._free_row(req)
        return True

    def _free_row(self, req: Request) -> None:
        row, req.row = req.row, -1
        tokens = self._tokens_to_cache(req)
        if row in self.inflight_rows:
            # Its KV is still in use on the device (and the pass in flight completes its last rows).
            self._deferred_rows.append((self.inflight_step, row, tokens))
            return
        self._release_row(row, tokens)

    def _tokens_to_cache(self, req: Request) -> list[int] | None:
        """The tokens whose KV the request's pages hold once its passes have finished (prefix caching only): every
        computed position whose token id the host knows."""
        if self.kv.prefix is None or req.remote_prefill:
            return None
        known = req.prompt_ids + req.output_ids
        return known[: min(req.num_computed, len(known))]

    def _release_row(self, row: int, tokens: list[int] | None = None) -> None:
        self.kv.free(row, tokens)
        self._free_rows.append(row)

    def release_rows_of(self, step_id: int) -> None:
        """Step `step_id` (and every earlier one) has finished on the device: free the rows deferred for it."""
        if not self._deferred_rows:
            return
        keep = []
        for step, row, tokens in self._deferred_rows:
            if step <= step_id:
                self._release_row(row, tokens)
            else:
                keep.append((step, row, tokens))
        self._deferred_rows = keep

    # -- one step --
    def schedule(self) -> ScheduledBatch | None:
        self._resume_retracted()
        if not self.retracted:
            self._admit_waiting()
        decoding = any(not r.reached_max_tokens for r in self.running)
        if self.prefilling and not (self._last_was_prefill and decoding):
            self._last_was_prefill = True
            return self._prefill_batch()
        self._last_was_prefill = False
        if self.running:
            return self._decode_batch()
        if (self.waiting or self.retracted) and not (self.transferring or self.held or self._deferred_rows):
            # Nothing runs and nothing can start: only possible if the budgets are inconsistent.
            raise RuntimeError("scheduler stalled: queued requests cannot be admitted into an idle engine")
        return None

    # -- growth estimates --
    def _expected_tokens(self, req: Request, ratio: float) -> int:
        """Tokens of KV the request is expected to hold at its end: what it has plus `ratio` of what it may
        still generate (clipped), never more than its maximum."""
        remaining = req.params.max_tokens - req.num_output_tokens
        return min(req.max_total_len, req.num_tokens + math.ceil(ratio * min(remaining, CLIP_MAX_NEW_TOKENS)))

    def _reserved_pages(self) -> int:
        """Pages the requests holding memory are expected to still take."""
        return sum(self.kv.pages_needed(r.row, self._expected_tokens(r, self.new_token_ratio))
                   for r in (*self.prefilling, *self.running))

    def _resume_retracted(self) -> None:
        """Resume the oldest retracted requests while their pages are free, plus one spare page per request
        holding memory, so that those can grow a page each before anyone must be retracted again (no
        retract/resume ping-pong)."""
        while self.retracted:
            req = self.retracted[0]
            spare = len(self.running) + len(self.prefilling)
            need = self.kv.pages_needed(req.row, req.num_computed + 1) + spare
            if not self.kv.can_start_request() or self.kv.free_pages() < need:
                return
            if not self.kv.try_resume(req.row, req.num_computed):
                return
            self.retracted.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            logger.debug("resumed %s at %d tokens", req.rid, req.num_computed)

    def _admit_waiting(self) -> None:
        """Admit every waiting request that fits now, oldest first. One that does not fit is passed by later
        ones (no head-of-line blocking) until `HOL_BYPASS_LIMIT` have gone ahead of it; then the queue waits
        for it, so a large request is never starved by a stream of small ones."""
        reserved = self._reserved_pages()
        blocked: Request | None = None
        for req in list(self.waiting):
            if not self._free_rows or not self.kv.can_start_request():
                return
            if blocked is not None and blocked.num_bypassed >= HOL_BYPASS_LIMIT:
                return
            # SGLang's check: the request's prompt and its clipped max_tokens must fit beside what the others
            # are expected to take; once admitted, it is expected to take only its ratio. Pages of its prompt
            # found in the prefix cache are not needed.
            need = self.kv.pages_needed(self._free_rows[-1], self._expected_tokens(req, self.new_request_ratio))
            if self.kv.prefix is not None and req.uses_prefix_cache:
                need -= self._cached_prefix_tokens(req) // self.kv.page_size
            if self.kv.free_pages() - reserved >= need and self.try_admit(req):
                reserved += self.kv.pages_needed(req.row, self._expected_tokens(req, self.new_token_ratio))
                if blocked is not None:
                    blocked.num_bypassed += 1
            elif blocked is None:
                blocked = req

    def _cached_prefix_tokens(self, req: Request) -> int:
        """What admission would find cached of the request's prompt now, looked up again only once the cache
        changed since the last look."""
        version = self.kv.prefix_cache_version
        if req.cached_prefix_probe is None or req.cached_prefix_probe[0] != version:
            req.cached_prefix_probe = (version, self.kv.cached_prefix_tokens(req.prompt_ids))
        return req.cached_prefix_probe[1]

    def try_admit(self, req: Request) -> bool:
        """Move a waiting request to prefill if a request row and the pages for its prompt are available now."""
        if not self._free_rows:
            return False
        row = self._free_rows[-1]
        prompt_ids = req.prompt_ids if req.uses_prefix_cache else None  # PD decode: the KV comes from prefill
        if not self.kv.try_admit(row, req.prompt_len, req.max_total_len, prompt_ids):
            return False
        self._free_rows.pop()
        self.waiting.remove(req)
        req.row = row
        req.num_cached_tokens = self.kv.cached_tokens(row)
        req.num_computed = req.num_cached_tokens  # its prefill starts after the cached prefix
        if req.remote_prefill:
            req.status = RequestStatus.TRANSFERRING
            self.transferring.append(req)
            self.newly_transferring.append(req)
            return True
        req.status = RequestStatus.PREFILLING
        self.prefilling.append(req)
        return True

    def pop_newly_transferring(self) -> list[Request]:
        out, self.newly_transferring = self.newly_transferring, []
        return out

    def commit_transferred(self, req: Request) -> None:
        """PD decode: the prompt's KV arrived (and its first token): join the decode set as after a prefill."""
        self.transferring.remove(req)
        self.kv.finish_prefill(req.row, req.num_computed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _prefill_batch(self) -> ScheduledBatch:
        budget = self.chunked_prefill_size
        reqs, prefix, extend = [], [], []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.prompt_len - req.num_computed, budget)
            if self.fixed_prefill_chunks:
                n = min(req.prompt_len - req.num_computed, self.chunked_prefill_size)
                if n > budget:
                    break  # its whole next chunk runs in a later pass
            budget -= n
            reqs.append(req)
            prefix.append(req.num_computed)
            extend.append(n)
        return ScheduledBatch(reqs, prefix, extend, is_decode=False)

    def _decode_batch(self) -> ScheduledBatch:
        """Every running request, except those whose last token is already sampled but not yet read (overlap
        scheduling: a request that reached max_tokens in the step still on the device never runs again)."""
        self.running.sort(key=self.order)  # the last is the first retracted
        reqs = [r for r in self.running if not r.reached_max_tokens]
        i = 0
        retracted = False
        while i < len(reqs):
            req = reqs[i]
            if self.kv.ensure_room(req.row, req.num_computed + 1):
                i += 1
                continue
            if not self.kv.supports_retraction:
                raise RuntimeError(f"{type(self.kv).__name__} ran out of memory for {req.rid} mid-decode")
            self._retract(reqs.pop())
            retracted = True
        if retracted:
            self._raise_ratio_after_retraction()
        else:
            self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - self.new_token_ratio_decay)
        return ScheduledBatch(reqs, [r.num_computed for r in reqs], [1] * len(reqs), is_decode=True)

    def _raise_ratio_after_retraction(self) -> None:
        """SGLang's re-estimate: what the remaining batch decoded so far, plus some steps each, over max_tokens."""
        decoded = sum(r.num_output_tokens for r in self.running)
        total = sum(r.params.max_tokens for r in self.running)
        estimate = (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (total + 1)
        self.new_token_ratio = min(1.0, max(self.new_token_ratio, estimate))

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.retract(req.row, req.num_computed)
        req.status = RequestStatus.RETRACTED
        self.retracted.append(req)
        self.retracted.sort(key=self.order)
        self.num_retractions += 1
        logger.info("retracted %s at %d tokens (%d running)", req.rid, req.num_computed, len(self.running))

    def on_prefill_done(self, req: Request) -> None:
        """The prompt's KV is complete and its first token sampled: join the decode set (and offer the prompt's
        pages to the prefix cache)."""
        self.prefilling.remove(req)
        self.kv.cache_prompt(req.row, req.prompt_ids)
        self.kv.finish_prefill(req.row, req.num_computed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
