"""One layer's swap-in tables: what every swap-in implementation reads and updates besides the batch.

A swap-in call is `(top_k_tokens, seq_lens, req_rows)` — the batch, new every step — against one layer's
`SwapInTables` — the same for every step of that layer. The reference (kernels/swap_in_ref.py), the CUDA path
(kernels/swap_in_cuda.py, which unpacks the tables into the extension's arguments) and the dispatchers
(kernels/dispatch.py: `swap_in`, `BoundSwapIn`) all take this one object, and `check` holds the argument checks
they share. The layout is docs/architecture.md "HiSparse memory layout".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)  # tensors: equal only to itself
class SwapInTables:
    """One layer's HiSparse swap-in state (D LRU positions and R ring slots per request row).

    - `buffer_slots` [max_reqs, D + R] int32: device slot of each LRU position and ring slot (all layers share it);
    - `buffer_tokens` [max_reqs, D] int32: the token each LRU position holds in this layer (−1: none); updated;
    - `lru_order` [max_reqs, D] int32: this layer's LRU positions, least recently used first; updated;
    - `host_rows` [max_reqs, max_ctx] int32: the host row of each token of each request;
    - `host_pool` [N_host, row_bytes] uint8: this layer's host rows (pinned, or on the GPU, for the CUDA path);
    - `device_pool` [N_dev, row_bytes] uint8: this layer's device rows; misses are copied here;
    - `num_recent`: R, ring slots per request (>= 1: the current token lives in the ring);
    - `counters` [2] int64 (hits, misses), accumulated in place, or None.
    """

    buffer_slots: torch.Tensor
    buffer_tokens: torch.Tensor
    lru_order: torch.Tensor
    host_rows: torch.Tensor
    host_pool: torch.Tensor
    device_pool: torch.Tensor
    num_recent: int
    counters: torch.Tensor | None = None

    def extension_args(self) -> tuple:
        """The tables in the order of the CUDA extension's `swap_in` (after the batch) and `SwapInContext`."""
        return (self.buffer_slots, self.buffer_tokens, self.lru_order, self.host_rows, self.host_pool,
                self.device_pool, int(self.num_recent), self.counters)  # fmt: skip

    def check(self, top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor) -> tuple[int, int, int]:
        """Validate the batch against these tables: shapes and dtypes every implementation needs (ValueError);
        returns (B, K, D)."""
        if top_k_tokens.dim() != 2 or top_k_tokens.dtype != torch.int32:
            raise ValueError(f"top_k_tokens must be [B, K] int32, got {tuple(top_k_tokens.shape)} {top_k_tokens.dtype}")
        batch, top_k = top_k_tokens.shape
        if seq_lens.shape != (batch,) or req_rows.shape != (batch,):
            raise ValueError(
                f"seq_lens and req_rows must be [{batch}], got {tuple(seq_lens.shape)}, {tuple(req_rows.shape)}"
            )
        if self.buffer_tokens.dim() != 2 or self.lru_order.shape != self.buffer_tokens.shape:
            raise ValueError("buffer_tokens and lru_order must both be [max_reqs, D] (one layer)")
        for name in ("buffer_slots", "buffer_tokens", "lru_order", "host_rows"):
            dtype = getattr(self, name).dtype
            if dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {dtype}")
        buffer_size = self.buffer_tokens.shape[1]
        num_recent = self.num_recent
        if num_recent < 1:
            raise ValueError(f"num_recent must be >= 1 (the current token lives in the recent ring), got {num_recent}")
        if self.buffer_slots.dim() != 2 or self.buffer_slots.shape[1] != buffer_size + num_recent:
            raise ValueError(
                f"buffer_slots must be [max_reqs, D + R] = [*, {buffer_size + num_recent}], got "
                f"{tuple(self.buffer_slots.shape)}"
            )
        if buffer_size < top_k:
            raise ValueError(
                f"device buffer size D={buffer_size} must be >= top_k K={top_k}: each miss needs an LRU slot "
                "that no selected token occupies"
            )
        host_pool, device_pool = self.host_pool, self.device_pool
        if host_pool.dim() != 2 or device_pool.dim() != 2 or host_pool.shape[1] != device_pool.shape[1]:
            raise ValueError(
                f"host_pool and device_pool must be [N, row_bytes] with equal row_bytes, got "
                f"{tuple(host_pool.shape)} and {tuple(device_pool.shape)}"
            )
        if host_pool.dtype != torch.uint8 or device_pool.dtype != torch.uint8:
            raise ValueError("host_pool and device_pool must be uint8 row tensors")
        counters = self.counters
        if counters is not None and (counters.shape != (2,) or counters.dtype != torch.int64):
            raise ValueError("counters must be a [2] int64 tensor (hits, misses) or None")
        return batch, top_k, buffer_size
