"""Data-parallel attention: each rank's own tokens through attention, every rank's tokens through the MLPs.

With `--enable-dp-attention` (`ParallelState.dp_size == tp_size`) rank r runs attention for its own requests
only, with all heads and its own KV. The MLP layers (dense and MoE) and the vocab-parallel LM head stay sharded
across all N ranks exactly as under tensor parallelism, so before each of them the ranks' hidden states are
gathered (`dp_gather`: every rank then holds all ranks' tokens, in rank order), every rank computes its shard's
partial output for all of them, and the partials are summed and handed back to the ranks that own the tokens
(`dp_combine`: a reduce-scatter). That is SGLang's all-gather + reduce-scatter dispatch around the MoE: a token
reaches every expert's owner, and comes back with the sum of its experts' outputs.

Ranks hold different numbers of tokens in a pass (a prefill chunk on one, a few decode tokens on another, none on
an idle rank), so every collective needs everyone's counts: `DPStepSync.agree` all-gathers them once per engine
step, before the forward, and the resulting `DPBatchLayout` is installed for the pass (`dp_batch`). Two ways to
move rows of different counts, chosen per pass from the counts alone (so identically on every rank), as SGLang's
`DpPaddingMode` does:
- max-len: pad every rank's rows to the largest count, `all_gather_into_tensor`, `reduce_scatter_tensor`;
- sum-len: each rank writes its rows at its offset of a zeroed [sum, hidden] buffer, `all_reduce` (the zeros
  add nothing, exactly), and the partials are `all_reduce`d and each rank keeps its own rows.
Max-len moves N · max rows per collective, sum-len about 2 · sum (ring all-reduce): max-len is taken when
2 · sum >= N · max (balanced decode batches), sum-len otherwise (one rank prefilling a chunk).

A rank with no tokens in a pass (an idle batch) still runs the forward: it skips attention (nothing to attend)
and joins every MLP collective with zero rows, so no rank waits for it. Ranks agree on whether a pass happens at
all: when every rank's count is zero nobody runs one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from decode_server.parallel.state import ParallelState

# torch >= 2.13 names them *_single (the *_tensor names are deprecated there, and all older torch has).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class DPBatchLayout:
    """Token and sampled-row counts of every DP rank in one forward pass, and which rank this is. `graphable`:
    per rank, whether its pass could replay a decode graph (a decode batch of one sampled token a request, or no
    batch); a graph pass needs every rank's yes (empty: not agreed on)."""

    num_tokens: tuple[int, ...]
    num_sampled: tuple[int, ...]
    rank: int
    graphable: tuple[bool, ...] = ()

    @property
    def size(self) -> int:
        return len(self.num_tokens)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def idle(self) -> bool:
        """This rank has no token in the pass (it joins the collectives with zero rows)."""
        return self.num_tokens[self.rank] == 0

    def graph_batch(self) -> int | None:
        """The largest rank's batch when every rank can replay a decode graph (every rank then pads to one bucket
        that holds it), else None."""
        if not self.graphable or not all(self.graphable):
            return None
        return max(self.num_tokens)


_layout: contextvars.ContextVar[DPBatchLayout | None] = contextvars.ContextVar("dp_batch_layout", default=None)


@contextlib.contextmanager
def dp_batch(layout: DPBatchLayout | None) -> Iterator[None]:
    """Install the pass's layout for the model's DP collectives (None: not a DP pass; nothing installed)."""
    token = _layout.set(layout)
    try:
        yield
    finally:
        _layout.reset(token)


def current_layout() -> DPBatchLayout:
    layout = _layout.get()
    if layout is None:
        raise RuntimeError("a data-parallel-attention model ran outside a DP pass: the engine installs every rank's "
                           "token counts (parallel.dp_attention.dp_batch) around each forward")
    return layout


def use_max_len(counts: tuple[int, ...]) -> bool:
    """Pad to the largest count (all-gather / reduce-scatter) unless the counts are so uneven that summing into
    a buffer of the total moves fewer bytes (SGLang's rule)."""
    return 2 * sum(counts) >= max(counts) * len(counts)


def _offsets(counts: tuple[int, ...]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


@functools.lru_cache(maxsize=64)
def _real_rows(counts: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """Indices of the real rows in the rank-major padded layout ([N · width] rows, rank r's at r · width); built once
    per layout (every MLP layer of a pass asks for the same), not per layer."""
    return torch.cat([torch.arange(r * width, r * width + c, device=device) for r, c in enumerate(counts)])


def gather_rows(x: torch.Tensor, counts: tuple[int, ...], rank: int, state: ParallelState,
                max_len: bool | None = None) -> torch.Tensor:  # fmt: skip
    """Every rank's rows of x ([counts[rank], ...]) stacked in rank order: [sum(counts), ...] on every rank.
    `max_len`: the padding mode (None: `use_max_len(counts)`; every rank must pass the same)."""
    total = sum(counts)
    if len(counts) == 1 or total == 0:  # every rank sees the same counts: all skip the collective alike
        return x
    x = x.contiguous()
    if use_max_len(counts) if max_len is None else max_len:
        width = max(counts)
        padded = x
        if x.shape[0] != width:
            padded = x.new_zeros((width, *x.shape[1:]))
            padded[: x.shape[0]] = x
        out = x.new_empty((width * len(counts), *x.shape[1:]))
        _all_gather(out, padded, group=state.group)
        return out if width * len(counts) == total else out[_real_rows(counts, width, x.device)]
    out = x.new_zeros((total, *x.shape[1:]))
    start = _offsets(counts)[rank]
    out[start : start + x.shape[0]] = x
    dist.all_reduce(out, group=state.group)
    return out


def reduce_scatter_rows(partial: torch.Tensor, counts: tuple[int, ...], rank: int, state: ParallelState,
                        max_len: bool | None = None) -> torch.Tensor:  # fmt: skip
    """The sum over ranks of `partial` ([sum(counts), ...], rows in rank order, on every rank), of which this rank
    keeps its own rows: [counts[rank], ...]. The inverse of `gather_rows` for a sum of per-rank partials."""
    if len(counts) == 1 or sum(counts) == 0:
        return partial
    partial = partial.contiguous()
    mine = counts[rank]
    if use_max_len(counts) if max_len is None else max_len:
        width = max(counts)
        if width * len(counts) == partial.shape[0]:
            padded = partial
        else:
            padded = partial.new_zeros((width * len(counts), *partial.shape[1:]))
            padded[_real_rows(counts, width, partial.device)] = partial
        out = partial.new_empty((width, *partial.shape[1:]))
        _reduce_scatter(out, padded, group=state.group)
        return out[:mine]
    dist.all_reduce(partial, group=state.group)
    start = _offsets(counts)[rank]
    return partial[start : start + mine]


def dp_gather(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """This pass's tokens of every rank ([T_r, hidden] → [ΣT, hidden]), for an MLP layer."""
    layout = current_layout()
    return gather_rows(x, layout.num_tokens, layout.rank, state)


def dp_combine(partial: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum every rank's partial MLP output over all tokens and keep this rank's rows ([ΣT, h] → [T_r, h])."""
    layout = current_layout()
    return reduce_scatter_rows(partial, layout.num_tokens, layout.rank, state)


def dp_gather_sampled(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """The rows every rank samples from in this pass ([B_r, hidden] → [ΣB, hidden]), for the vocab-parallel head."""
    layout = current_layout()
    return gather_rows(x, layout.num_sampled, layout.rank, state)


def dp_own_sampled(x: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a [ΣB, ...] tensor computed for every rank's sampled rows."""
    layout = current_layout()
    start = _offsets(layout.num_sampled)[layout.rank]
    return x[start : start + layout.num_sampled[layout.rank]]


class DPStepSync:
    """Once per engine step, on every DP rank: agree on the pass (everyone's token and sampled-row counts) and
    share one small number per rank that the runtime reads (`hint`: how soon that rank needs the next loop
    iteration, so rank 0 knows whether to block on the api's socket). One all-gather of 4 integers per rank
    (tokens, sampled rows, whether its pass could replay a decode graph, the hint), on the gloo `cpu_group` (host
    values, no device sync)."""

    def __init__(self, state: ParallelState) -> None:
        if not state.dp_attention:
            raise ValueError("DPStepSync needs data-parallel attention (dp_size > 1)")
        self.state = state
        self.hint = 0  # set by the runtime before each step
        self.hints: tuple[int, ...] = (0,) * state.dp_size  # every rank's hint, from the latest agreement
        self.num_agreements = 0

    def agree(self, num_tokens: int, num_sampled: int, graphable: bool = False) -> DPBatchLayout:
        mine = torch.tensor([num_tokens, num_sampled, int(graphable), self.hint], dtype=torch.int64)
        every = torch.empty(self.state.dp_size * 4, dtype=torch.int64)
        _all_gather(every, mine, group=self.state.cpu_group)
        rows = every.view(self.state.dp_size, 4).tolist()
        self.hints = tuple(int(r[3]) for r in rows)
        self.num_agreements += 1
        return DPBatchLayout(tuple(int(r[0]) for r in rows), tuple(int(r[1]) for r in rows), self.state.dp_rank,
                             tuple(bool(r[2]) for r in rows))
