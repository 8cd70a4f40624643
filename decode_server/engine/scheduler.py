"""Continuous-batching scheduler: waiting queue → admission → chunked prefill → decode set, with retraction.

Each call to `schedule()` picks one forward pass:
1. resume retracted requests (oldest first) when memory allows; while any remain, new requests wait;
2. admit waiting requests (FIFO) while a request row is free and the KV manager accepts them;
3. if some admitted request still has prompt left, a prefill batch of prompt chunks under the token budget
   (`chunked_prefill_size`), so new requests join the decode batch quickly — but never two prefill passes in a
   row while requests are decoding: prefill and decode alternate, so a long prompt delays each running request
   by at most one chunk per token;
4. otherwise one decode step for every running request. Before it, each request gets room for its next token;
   when memory runs out, the newest running requests are retracted until the rest fit.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from decode_server.engine.kv_manager import KVManager
from decode_server.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


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
        self, kv: KVManager, max_running_requests: int, chunked_prefill_size: int, fixed_prefill_chunks: bool = False
    ) -> None:
        self.kv = kv
        self.max_running_requests = max_running_requests
        self.chunked_prefill_size = chunked_prefill_size
        # Deterministic inference: a prompt is always cut at multiples of chunked_prefill_size of its own tokens,
        # whatever else is prefilling (chunk boundaries change the indexer's GEMM shapes, hence its rounding).
        self.fixed_prefill_chunks = fixed_prefill_chunks
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.retracted: list[Request] = []
        self._free_rows = list(range(max_running_requests - 1, -1, -1))
        self.num_retractions = 0
        self._last_was_prefill = False

    # -- bookkeeping --
    @property
    def num_holding_rows(self) -> int:
        return len(self.prefilling) + len(self.running) + len(self.retracted)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.retracted)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request) -> None:
        """Take a request out of whichever set holds it and give back its memory (finish or abort)."""
        if req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        else:
            for group in (self.prefilling, self.running, self.retracted):
                if req in group:
                    group.remove(req)
                    break
            if req.row >= 0:
                self.kv.free(req.row)
                self._free_rows.append(req.row)
                req.row = -1
        req.status = RequestStatus.FINISHED

    # -- one step --
    def schedule(self) -> ScheduledBatch | None:
        self._resume_retracted()
        if not self.retracted:
            self._admit_waiting()
        if self.prefilling and not (self._last_was_prefill and self.running):
            self._last_was_prefill = True
            return self._prefill_batch()
        self._last_was_prefill = False
        if self.running:
            return self._decode_batch()
        if self.waiting or self.retracted:
            # Nothing runs and nothing can start: only possible if the budgets are inconsistent.
            raise RuntimeError("scheduler stalled: queued requests cannot be admitted into an idle engine")
        return None

    def _resume_retracted(self) -> None:
        while self.retracted:
            req = self.retracted[0]
            if not self.kv.try_resume(req.row, req.num_computed):
                return
            self.retracted.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            logger.debug("resumed %s at %d tokens", req.rid, req.num_computed)

    def _admit_waiting(self) -> None:
        while self.waiting and self.try_admit(self.waiting[0]):
            pass

    def try_admit(self, req: Request) -> bool:
        """Move a waiting request to prefill if a request row and its KV budgets are available now."""
        if not self._free_rows:
            return False
        row = self._free_rows[-1]
        if not self.kv.try_admit(row, req.prompt_len, req.max_total_len):
            return False
        self._free_rows.pop()
        self.waiting.remove(req)
        req.row = row
        req.status = RequestStatus.PREFILLING
        self.prefilling.append(req)
        return True

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
        self.running.sort(key=lambda r: r.arrival)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self.kv.ensure_room(req.row, req.num_computed + 1):
                i += 1
                continue
            if not self.kv.supports_retraction:
                raise RuntimeError(f"{type(self.kv).__name__} ran out of memory for {req.rid} mid-decode")
            self._retract(self.running[-1])
        reqs = list(self.running)
        return ScheduledBatch(reqs, [r.num_computed for r in reqs], [1] * len(reqs), is_decode=True)

    def _retract(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.retract(req.row, req.num_computed)
        req.status = RequestStatus.RETRACTED
        self.retracted.append(req)
        self.retracted.sort(key=lambda r: r.arrival)
        self.num_retractions += 1
        logger.info("retracted %s at %d tokens (%d running)", req.rid, req.num_computed, len(self.running))

    def on_prefill_done(self, req: Request) -> None:
        """The prompt's KV is complete and its first token sampled: join the decode set."""
        self.prefilling.remove(req)
        self.kv.finish_prefill(req.row, req.num_computed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
