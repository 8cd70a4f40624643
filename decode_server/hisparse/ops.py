"""The kernels HiSparse calls.

Swap-in (bound once per layer) and backup come from the `kernels` dispatchers (CUDA on GPU, references on CPU).
The indexer top-k and the sparse MLA attention are deliberately the very functions `DenseBackend` uses: HiSparse
is bit-identical to dense only if both modes score and attend with the same implementation, so when dense
switches kernels, HiSparse follows automatically.
"""

from __future__ import annotations

import torch

import kernels
from decode_server.engine import dense_backend


def bind_swap_in(tables: kernels.SwapInTables) -> kernels.BoundSwapIn:
    """One layer's swap-in with its tables bound once (`kernels.BoundSwapIn`); the backend makes one per layer."""
    return kernels.BoundSwapIn(tables)


def backup_rows(
    device_pool: torch.Tensor,
    host_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_rows: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    return kernels.backup_rows(device_pool, host_pool, src_slots, dst_rows, stream=stream)


def indexer_topk(*args, **kwargs) -> torch.Tensor:
    return dense_backend.indexer_topk(*args, **kwargs)


def write_index_rows(keys_dst: torch.Tensor, scales_dst: torch.Tensor, rows: torch.Tensor, keys_fp8: torch.Tensor,
                     scales: torch.Tensor) -> None:
    """The index-key write dense mode does (`kernels.write_index_rows`)."""
    kernels.write_index_rows(keys_dst, scales_dst, rows, keys_fp8, scales)


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, scale: float, d_v: int, reference: bool = False, *,
    kernel: str = "triton",
) -> torch.Tensor:
    return dense_backend.attend_in_chunks(q, kv, slots, scale, d_v, reference, kernel=kernel)
