"""Tensor-parallel layers, and the record of how each weight is cut so the loader can read only its slice.

Each layer keeps the batch-invariant arithmetic of `decode_server.model.batch_invariant` (fixed row tiles while
`--enable-deterministic-inference` is on). At tp_size 1 the factories return the plain single-device modules
(`Linear`, `nn.Embedding`), so a model built without parallelism is exactly today's, parameter for parameter.

A sharded parameter carries its cut in its module's `shards` dict (parameter name → `Shard`): the full tensor
is split into `count` equal contiguous pieces along `dim` and this rank holds piece `index`. Parameters absent
from `shards` are replicated (whole on every rank). A block-FP8 weight's `weight_scale_inv` is cut like the weight
(one scale row/column per 128-block: the weight's pieces must then start and end on block edges).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from decode_server.model.batch_invariant import Linear
from decode_server.parallel.comm import all_gather_last_dim, all_reduce
from decode_server.parallel.state import ParallelState


@dataclass(frozen=True)
class Shard:
    dim: int
    index: int
    count: int

    def bounds(self, full_size: int) -> tuple[int, int]:
        """[start, stop) of this piece along `dim` of a tensor whose full size there is `full_size`."""
        size = full_size // self.count
        return self.index * size, (self.index + 1) * size

    def full_shape(self, local_shape: torch.Size | tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] *= self.count
        return tuple(shape)


def split_size(total: int, parts: int, what: str) -> int:
    """total // parts, or a ValueError naming the size that does not split."""
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


class ColumnParallelLinear(Linear):
    """Output features split across ranks: weight [out/N, in] (and bias [out/N]); the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                 what: str = "output features") -> None:
        super().__init__(in_features, split_size(out_features, parallel.tp_size, what), bias=bias)
        self.shards = {"weight": Shard(0, parallel.tp_rank, parallel.tp_size)}
        if bias:
            self.shards["bias"] = Shard(0, parallel.tp_rank, parallel.tp_size)


class RowParallelLinear(Linear):
    """Input features split across ranks: weight [out, in/N]; each rank's partial product is summed by an
    all-reduce (unless `reduce` is False: the caller sums several partials and reduces once). The bias is
    replicated and added after the sum, once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                 reduce: bool = True, what: str = "input features") -> None:
        super().__init__(split_size(in_features, parallel.tp_size, what), out_features, bias=bias)
        self.parallel = parallel
        self.reduce = reduce
        self.shards = {"weight": Shard(1, parallel.tp_rank, parallel.tp_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(x)
        if self.reduce:
            out = all_reduce(out, self.parallel)
        if self.bias is not None:
            if not self.reduce:
                raise RuntimeError("a row-parallel linear with a bias must reduce its own output")
            out = out + self.bias
        return out


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks; each rank looks up the ids it holds (zeros elsewhere) and an
    all-reduce sums the pieces. Exactly one rank contributes a nonzero row per token, so the sum is exact."""

    def __init__(self, num_embeddings: int, embedding_dim: int, parallel: ParallelState) -> None:
        super().__init__()
        per_rank = split_size(num_embeddings, parallel.tp_size, "vocab_size")
        self.parallel = parallel
        self.start, self.stop = parallel.tp_rank * per_rank, (parallel.tp_rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        self.shards = {"weight": Shard(0, parallel.tp_rank, parallel.tp_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        held = (input_ids >= self.start) & (input_ids < self.stop)
        local = torch.where(held, input_ids - self.start, 0)
        out = nn.functional.embedding(local, self.weight)
        out = out.masked_fill(~held.unsqueeze(-1), 0)
        return all_reduce(out, self.parallel)


class ParallelLMHead(Linear):
    """Vocabulary split across ranks (weight [V/N, hidden]); the logits are all-gathered, so every rank
    returns the full [T, V] (each rank samples the same token from the same logits)."""

    def __init__(self, hidden_size: int, vocab_size: int, parallel: ParallelState) -> None:
        super().__init__(hidden_size, split_size(vocab_size, parallel.tp_size, "vocab_size"), bias=False)
        self.parallel = parallel
        self.shards = {"weight": Shard(0, parallel.tp_rank, parallel.tp_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_gather_last_dim(self.project(x), self.parallel)


def column_linear(in_features: int, out_features: int, bias: bool, parallel: ParallelState,
                  what: str = "output features") -> Linear:
    """`Linear` at tp_size 1, else ColumnParallelLinear."""
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, bias, parallel, what)


def row_linear(in_features: int, out_features: int, bias: bool, parallel: ParallelState, reduce: bool = True,
               what: str = "input features") -> Linear:
    """`Linear` at tp_size 1, else RowParallelLinear."""
    if parallel.tp_size == 1:
        return Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, parallel, reduce, what)


def embedding(num_embeddings: int, embedding_dim: int, parallel: ParallelState) -> nn.Module:
    if parallel.tp_size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, parallel)


def lm_head(hidden_size: int, vocab_size: int, parallel: ParallelState) -> Linear:
    if parallel.tp_size == 1:
        return Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(hidden_size, vocab_size, parallel)


def parameter_shards(model: nn.Module) -> dict[str, Shard]:
    """Full state-dict name → Shard of every sharded tensor of `model` (replicated tensors are absent)."""
    out: dict[str, Shard] = {}
    for prefix, module in model.named_modules():
        for name, shard in getattr(module, "shards", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = shard
    return out
