"""What a request's sampling parameters do to its logits before a token is picked: logit bias, min_tokens,
repetition / frequency / presence penalties.

The order and formulas are vLLM's (and OpenAI's for the two penalties it defines), so a client moving between
servers gets the same distribution: first `logit_bias` is added and, while a request has fewer than `min_tokens`
output tokens, its EOS and stop token ids are masked to −inf; then the repetition penalty divides the positive
logits (multiplies the negative ones) of every token seen in the prompt or the output; then the frequency penalty
subtracts `frequency_penalty × count` and the presence penalty `presence_penalty` for every token of the output.
Temperature, top-k and top-p come after (engine/sampler.py).

The counts live on the device, one row of a lazily grown `[slots, vocab]` table per request that uses a penalty,
built once from the token ids the host knows (when the request is first sampled here: a prefill's end, or a PD
decode server's first step) and then advanced on the device by each sampled token. That keeps overlap scheduling's
host-free step (the newest token is still on the device when the next pass is launched) and makes one batched
gather, one elementwise pass and one scatter a step, whatever the batch. A slot outlives retraction (the counts
stay valid) and is freed when the request ends for any reason. HiSparse and dense engines apply the same operations
to the same logits, so the bit-for-bit contract is untouched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from decode_server.engine.request import Request
from decode_server.engine.structured_output import GrammarBackend, allowed_tokens

logger = logging.getLogger(__name__)

_INITIAL_SLOTS = 8


@dataclass
class _StaticRows:
    """A request's constant per-step edits, kept on the host: bias entries and the ids min_tokens holds back."""

    bias_ids: list[int]
    bias_values: list[float]
    banned_ids: list[int]  # EOS (unless ignore_eos) and stop_token_ids


@dataclass
class _StepPlan:
    """One step's edits, laid out on the host and uploaded in two copies (ints, floats)."""

    rows: list[int]  # batch rows with any edit
    counted: list[int]  # of those, positions (into `rows`) of the rows that use counts
    counted_rows: list[int]  # their batch rows
    slots: list[int]  # their slots
    factors: list[float]  # their (repetition, frequency, presence), flattened
    bias: tuple[list[int], list[int], list[float]]  # (position in rows, token id, value)
    banned: tuple[list[int], list[int]]  # (position in rows, token id)
    repetition: bool  # some counted row has a repetition penalty
    constrained: list[int] = field(default_factory=list)  # positions (into `rows`) of rows with a grammar
    matchers: list[Any] = field(default_factory=list)  # their grammar matchers


class LogitsProcessor:
    """Applies each sampled request's logits processing in one batched pass and keeps the penalties' counts."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._counts: torch.Tensor | None = None  # int32 [slots, vocab]: each output token id's count
        self._seen_in_prompt: torch.Tensor | None = None  # bool [slots, vocab], only once a request needs it
        self._free_slots: list[int] = []
        self._slot_of: dict[str, int] = {}
        self._static: dict[str, _StaticRows] = {}
        self.grammar: GrammarBackend | None = None  # set by the engine when structured outputs are available
        self._matchers: dict[str, Any] = {}
        self._to_record: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (batch, rows, slots) of apply()
        self._minus_inf = torch.full((), float("-inf"), device=device)
        self._ones = torch.ones(0, dtype=torch.int32, device=device)  # grown on demand: the counts' increments

    # -- bookkeeping --
    @property
    def slots_in_use(self) -> int:
        return len(self._slot_of)

    def is_empty(self) -> bool:
        """No request holds a slot or cached edits (tests check that every ending frees them)."""
        return not self._slot_of and not self._static and not self._matchers

    def release(self, req: Request) -> None:
        """The request has ended (finished, aborted, failed): its slot goes back to the free list. A pass still in
        flight may advance the old counts; a new owner's rows are written after it on the same stream."""
        slot = self._slot_of.pop(req.rid, None)
        if slot is not None:
            self._free_slots.append(slot)
        self._static.pop(req.rid, None)
        self._matchers.pop(req.rid, None)

    def accept(self, req: Request, token: int) -> bool:
        """The host has read `token` of a constrained request: advance its matcher (a request not sampled here yet
        has none: its matcher starts from the tokens known then). False if the token breaks the grammar."""
        matcher = self._matchers.get(req.rid)
        return matcher is None or bool(matcher.accept_token(token))

    # -- one step --
    def apply(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Float32 logits [S, V] of the sampled `requests` → the logits to sample from: `logits` itself (as float32)
        when no row needs processing, else a processed copy (the original stays for the logprobs). `record` must
        follow with the tokens sampled from them."""
        logits = logits.float()
        self._to_record = None
        vocab = logits.shape[-1]
        plan = self._plan(requests, vocab)
        if plan is None:
            return logits
        bias_pos, bias_ids, bias_values = plan.bias
        ban_pos, ban_ids = plan.banned
        parts = [plan.rows, plan.counted, plan.counted_rows, plan.slots, bias_pos, bias_ids, ban_pos, ban_ids]
        ints = _upload(torch.tensor([v for part in parts for v in part], dtype=torch.int64), self.device)
        rows, counted, counted_rows, slots, bias_pos_t, bias_ids_t, ban_pos_t, ban_ids_t = ints.split(
            [len(part) for part in parts])
        floats = _upload(torch.tensor(plan.factors + bias_values, dtype=torch.float32), self.device)
        factors, bias_values_t = floats.split([len(plan.factors), len(bias_values)])
        every_row = len(plan.rows) == len(requests)  # rows are then 0..S-1 in order
        x = logits.clone() if every_row else logits.index_select(0, rows)
        if bias_ids:
            x.index_put_((bias_pos_t, bias_ids_t), x[bias_pos_t, bias_ids_t] + bias_values_t)  # each (row, id) once
        if ban_ids:
            x.index_put_((ban_pos_t, ban_ids_t), self._minus_inf)
        if plan.constrained:
            self._mask_grammar(x, plan, vocab)
        if plan.counted:
            self._penalize(x, counted, slots, factors.view(-1, 3), plan.repetition, len(plan.rows))
            self._to_record = (len(requests), counted_rows, slots)
        if every_row:
            return x
        out = logits.clone()
        out.index_copy_(0, rows, x)
        return out

    def record(self, tokens: torch.Tensor) -> None:
        """Advance the counts of the rows `apply` penalized by their just-sampled tokens ([S] on the device)."""
        if self._to_record is None:
            return
        batch, rows, slots = self._to_record
        self._to_record = None
        assert self._counts is not None and tokens.shape[0] == batch, "record() follows apply() on the same batch"
        vocab = self._counts.shape[1]
        flat = slots * vocab + tokens.index_select(0, rows)  # one slot per row: no two rows add to one count
        # scatter_add_ (atomics) rather than index_put_(accumulate=True), whose sort-based CUDA path may wait for
        # the device: this runs while the previous pass is still in flight (overlap scheduling).
        if self._ones.numel() < flat.numel():
            self._ones = torch.ones(2 * flat.numel(), dtype=torch.int32, device=self.device)
        self._counts.view(-1).scatter_add_(0, flat, self._ones[: flat.numel()])

    # -- the edits --
    def _plan(self, requests: list[Request], vocab: int) -> _StepPlan | None:
        plan = _StepPlan([], [], [], [], [], ([], [], []), ([], []), False)
        for i, req in enumerate(requests):
            p = req.params
            banning = req.num_output_tokens < p.min_tokens
            if not (p.logit_bias or banning or p.uses_token_counts or p.structured is not None):
                continue
            j = len(plan.rows)
            plan.rows.append(i)
            static = self._static_rows(req, vocab)
            if static.bias_ids:
                plan.bias[0].extend([j] * len(static.bias_ids))
                plan.bias[1].extend(static.bias_ids)
                plan.bias[2].extend(static.bias_values)
            if banning and static.banned_ids:
                plan.banned[0].extend([j] * len(static.banned_ids))
                plan.banned[1].extend(static.banned_ids)
            if p.uses_token_counts:
                plan.counted.append(j)
                plan.counted_rows.append(i)
                plan.slots.append(self._slot(req, vocab))
                plan.factors.extend((p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
                plan.repetition |= p.repetition_penalty != 1.0
            if p.structured is not None:
                plan.constrained.append(j)
                plan.matchers.append(self._matcher(req))
        return plan if plan.rows else None

    def _mask_grammar(self, x: torch.Tensor, plan: _StepPlan, vocab: int) -> None:
        """−inf on every token the rows' grammars do not allow next (the bitmask is filled on the host)."""
        assert self.grammar is not None
        allowed = allowed_tokens(_upload(self.grammar.bitmask(plan.matchers), self.device), vocab)
        if len(plan.constrained) == x.shape[0]:  # every row, in order
            x.masked_fill_(~allowed, float("-inf"))
            return
        rows = _to(plan.constrained, torch.int64, self.device)
        y = x.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
        x.index_copy_(0, rows, y)

    def _matcher(self, req: Request) -> Any:
        matcher = self._matchers.get(req.rid)
        if matcher is None:
            if self.grammar is None or req.grammar is None:
                raise RuntimeError(f"{req.rid}: a structured output without a compiled grammar")
            if req.num_pending:
                raise RuntimeError(f"{req.rid}: its grammar must start from known tokens ({req.num_pending} pending)")
            matcher = self._matchers[req.rid] = self.grammar.matcher(req.grammar, req.output_ids)
        return matcher

    def _penalize(self, x: torch.Tensor, counted: torch.Tensor, slots: torch.Tensor, factors: torch.Tensor,
                  repetition: bool, num_rows: int) -> None:
        """Repetition, then frequency, then presence penalties on the rows `counted` of `x` (vLLM's formulas; a
        factor of 1 or 0 leaves a row's logits exactly as they were)."""
        assert self._counts is not None
        rep, freq, presence = factors[:, 0:1], factors[:, 1:2], factors[:, 2:3]
        counts = self._counts.index_select(0, slots)
        in_output = counts > 0
        whole = counted.shape[0] == num_rows  # every row counted, in order
        y = x if whole else x.index_select(0, counted)
        if repetition:
            assert self._seen_in_prompt is not None
            seen = in_output | self._seen_in_prompt.index_select(0, slots)
            y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - freq * counts  # int32 counts promote to float32
        y = y - presence * in_output
        if whole:
            x.copy_(y)
        else:
            x.index_copy_(0, counted, y)

    # -- per-request state --
    def _static_rows(self, req: Request, vocab: int) -> _StaticRows:
        static = self._static.get(req.rid)
        if static is None:
            p = req.params
            bad = [t for t in p.logit_bias if t >= vocab]
            if bad:
                raise ValueError(f"{req.rid}: logit_bias token id {bad[0]} is outside the vocabulary ({vocab})")
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(req.eos_token_ids))
            static = _StaticRows(bias_ids=list(p.logit_bias), bias_values=list(p.logit_bias.values()),
                                 banned_ids=sorted(t for t in banned if t < vocab))
            self._static[req.rid] = static
        return static

    def _slot(self, req: Request, vocab: int) -> int:
        """The request's row of counts, made on first use from the ids the host knows."""
        slot = self._slot_of.get(req.rid)
        if slot is not None:
            return slot
        if req.num_pending:
            raise RuntimeError(f"{req.rid}: its counts must start from known tokens ({req.num_pending} pending)")
        slot = self._take_slot(vocab, need_prompt=req.params.repetition_penalty != 1.0)
        assert self._counts is not None
        self._counts[slot].zero_()
        if req.output_ids:
            ids = _to(req.output_ids, torch.int64, self.device)
            self._counts[slot].scatter_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        if self._seen_in_prompt is not None:
            self._seen_in_prompt[slot].zero_()
            if req.params.repetition_penalty != 1.0:
                self._seen_in_prompt[slot].index_fill_(0, _to(req.prompt_ids, torch.int64, self.device), True)
        self._slot_of[req.rid] = slot
        return slot

    def _take_slot(self, vocab: int, need_prompt: bool) -> int:
        if self._counts is None:
            self._counts = torch.zeros(_INITIAL_SLOTS, vocab, dtype=torch.int32, device=self.device)
            self._free_slots = list(range(_INITIAL_SLOTS - 1, -1, -1))
        if need_prompt and self._seen_in_prompt is None:
            self._seen_in_prompt = torch.zeros(self._counts.shape, dtype=torch.bool, device=self.device)
        if not self._free_slots:
            self._grow()
        return self._free_slots.pop()

    def _grow(self) -> None:
        assert self._counts is not None
        old = self._counts.shape[0]
        self._counts = torch.cat((self._counts, torch.zeros_like(self._counts)))
        if self._seen_in_prompt is not None:
            self._seen_in_prompt = torch.cat((self._seen_in_prompt, torch.zeros_like(self._seen_in_prompt)))
        self._free_slots.extend(range(2 * old - 1, old - 1, -1))
        logger.info("penalty counts grown to %d requests (%.1f MiB)", 2 * old,
                    self._counts.numel() * (5 if self._seen_in_prompt is not None else 4) / 2**20)


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a sync."""
    return _upload(torch.tensor(values, dtype=dtype), device)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on the device without waiting for the stream (a pageable non-blocking copy is staged
    by the driver at once, as the engine's input ids are)."""
    return host.to(device, non_blocking=True)
