"""Collectives over the TP group; each is a no-op (returns its input) at tp_size 1.

gloo and NCCL give every rank the same bits from an all-reduce, so anything computed from a reduced tensor is
identical on every rank (what keeps the replicated indexer's top-k identical across ranks).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from decode_server.parallel.state import ParallelState


def all_reduce(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Sum of x over the ranks, in place; returns x."""
    if state.tp_size == 1:
        return x
    dist.all_reduce(x, group=state.group)
    return x


def all_gather_last_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Every rank's x concatenated along the last dim, in rank order ([..., n] → [..., n · tp_size])."""
    if state.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.cat(parts, dim=-1)


def all_gather_first_dim(x: torch.Tensor, state: ParallelState) -> torch.Tensor:
    """Every rank's x stacked along a new first dim ([...] → [tp_size, ...]); for checks across ranks."""
    if state.tp_size == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(state.tp_size)]
    dist.all_gather(parts, x, group=state.group)
    return torch.stack(parts)
