"""One forward pass's batch: which tokens of which requests it computes, and the scratch row padded batches use.

The data half of the forward state: the model, the engine and every attention backend read a `ForwardBatch`;
decode_server/engine/forward_context.py installs one with its backend for the duration of a pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Every per-request table has one row more than the engine has request rows (the scratch row, index
# `max_requests`), and every pool that new tokens are written to has SCRATCH_SLOTS rows past its allocator: the
# padded rows of a static decode batch (CUDA graph buckets) are requests of that row, decoding their first token
# into the first scratch slot, so they never touch a request's memory. One page of 64 keeps the power-of-two
# factors of the pool sizes (FlashMLA pages a pool by the largest power of two <= 64 that divides it).
SCRATCH_SLOTS = 64


def map_scratch_row(table: torch.Tensor, scratch_row: int, first_slot: int) -> None:
    """Token 0 of the scratch row lives at `first_slot` (the first scratch slot); nothing else is mapped."""
    table[scratch_row].fill_(-1)
    table[scratch_row, 0] = first_slot


@dataclass
class ForwardBatch:
    """One forward pass: for each request, a run of new tokens appended after its cached prefix.

    Decode is the special case `extend_lens == 1` for every request. All tensors live on the model's device
    except the `*_cpu` lists, which the scheduler already has and which avoid device syncs in Python loops.
    """

    req_rows: torch.Tensor  # [B] int64: each request's row in the engine's request tables
    prefix_lens: torch.Tensor  # [B] int64: tokens already in the KV cache before this pass
    extend_lens: torch.Tensor  # [B] int64: new tokens per request (1 in decode)
    positions: torch.Tensor  # [T] int64: absolute position of each new token
    token_req: torch.Tensor  # [T] int64: index 0..B-1 of the request each new token belongs to
    req_rows_cpu: list[int] = field(default_factory=list)
    prefix_lens_cpu: list[int] = field(default_factory=list)
    extend_lens_cpu: list[int] = field(default_factory=list)
    is_decode: bool = False
    # Padded decode batches (CUDA graph buckets, decode_server/engine/cuda_graph.py): the rows past the real ones
    # belong to the backends' scratch row. `pad_mask` [B] bool marks them (their indexer sees no position, so
    # their top-k is all -1: they read nothing and count no swap-in hit); `static`: the tensors are views of the
    # graph runner's static buffers and `begin_forward`/`end_forward` do device work only (capturable), the host
    # side being done by `prepare_static_forward`/`finish_static_forward`; `index_width`: every request's token
    # table is read at this fixed width (the table's) instead of the longest sequence's, so no shape depends on
    # the step.
    pad_mask: torch.Tensor | None = None
    static: bool = False
    index_width: int | None = None

    @property
    def batch_size(self) -> int:
        return len(self.req_rows_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def seq_lens_cpu(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens_cpu, self.extend_lens_cpu, strict=True)]

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    def token_table_width(self) -> int:
        """Columns of the per-request token tables the indexer reads: fixed for static batches, else the longest
        sequence of the batch."""
        return self.index_width if self.index_width is not None else max(self.seq_lens_cpu)

    def mask_padded_topk(self, topk: torch.Tensor) -> torch.Tensor:
        """Top-k positions [T, K] with the padded rows' entries set to -1 (decode: one token per row)."""
        if self.pad_mask is None:
            return topk
        return topk.masked_fill(self.pad_mask.unsqueeze(1), -1)

    def indexer_query_lens(self) -> torch.Tensor:
        """[T] int64: the positions each query's indexer sees (its own included), 0 for a padded row — whose
        selection is then all −1 by the top-k rule (n <= top_k: 0..n−1, then −1), what `mask_padded_topk` gives,
        without a masking kernel in every layer. The backends make it once a forward (begin_forward)."""
        lens = self.positions + 1
        return lens if self.pad_mask is None else lens.masked_fill(self.pad_mask, 0)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Index in [0, T) of each request's last new token (whose logits are sampled)."""
        return torch.cumsum(self.extend_lens, 0) - 1

    @classmethod
    def build(
        cls,
        req_rows: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        device: torch.device | str,
    ) -> ForwardBatch:
        """Derive positions and token→request maps from per-request lengths."""
        if not (len(req_rows) == len(prefix_lens) == len(extend_lens)):
            raise ValueError("req_rows, prefix_lens and extend_lens must have the same length")
        if any(e <= 0 for e in extend_lens):
            raise ValueError("every request in a forward batch must extend by at least one token")
        positions = [p + i for p, e in zip(prefix_lens, extend_lens, strict=True) for i in range(e)]
        token_req = [b for b, e in enumerate(extend_lens) for _ in range(e)]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        return cls(
            req_rows=as_tensor(req_rows),
            prefix_lens=as_tensor(prefix_lens),
            extend_lens=as_tensor(extend_lens),
            positions=as_tensor(positions),
            token_req=as_tensor(token_req),
            req_rows_cpu=list(req_rows),
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            is_decode=all(e == 1 for e in extend_lens),
        )
