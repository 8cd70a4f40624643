"""HiSparse swap-in on the GPU: a plan kernel (one block per request) and a copy kernel spread over every
miss of the batch, reading pinned host rows directly through UVA (kernels/csrc/hisparse_kernels.cu).
Same arguments and results as kernels/swap_in_ref.py, which is its test oracle.

`swap_in_cuda` binds nothing: each call unpacks the layer's `SwapInTables` into the extension's eleven arguments
and the extension resolves the host pool's UVA address again. `bind_swap_in_cuda` returns the extension's
`SwapInContext`, which binds one layer's tables once and is then called with the batch alone (the HiSparse
backend's path, through `kernels.BoundSwapIn`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.cuda_ext import load_extension
from kernels.swap_in_tables import SwapInTables


def swap_in_cuda(
    top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor, tables: SwapInTables,
    check: bool = True, max_copy_blocks: int = 0,
) -> torch.Tensor:  # fmt: skip
    """See kernels/swap_in_ref.py. All tensors on the device pool's GPU except the host pool, which must be
    pinned (or on that GPU). Asynchronous on the current stream.

    `check=False` skips the Python argument checks (ValueErrors with clear messages; ~5 µs of host time per call,
    measured in docs/benchmarks-history.md) for a caller that already passed the same tables and pools with checks, as
    `kernels.BoundSwapIn` does for every top-k shape after its first; the extension keeps its own checks.

    `max_copy_blocks` caps the copy kernel's grid (0: its default, two blocks an SM, one row a warp; a capped grid
    keeps 4 rows a warp in flight); the result is the same, only how many SMs the copy occupies changes (a swap-in
    on a side stream: `SwapInContext.max_copy_blocks`)."""
    if check:
        check_swap_in_cuda_args(top_k_tokens, seq_lens, req_rows, tables)
    return load_extension().swap_in(top_k_tokens, seq_lens, req_rows, *tables.extension_args(), max_copy_blocks)


def bind_swap_in_cuda(tables: SwapInTables) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The extension's `SwapInContext` for one layer: `ctx(top_k_tokens, seq_lens, req_rows)` equals
    `swap_in_cuda(top_k_tokens, seq_lens, req_rows, tables, check=False)`.

    The context reads the tensors' addresses (and the host pool's UVA address) once, so they must not be resized
    or re-pointed while it lives. It checks only what memory safety needs (RuntimeError); the Python argument
    checks are `check_swap_in_cuda_args`, which `kernels.BoundSwapIn` runs once per top-k shape."""
    if not tables.host_pool.is_cuda and not tables.host_pool.is_pinned():
        raise ValueError("host_pool must be pinned host memory (the GPU reads it directly through UVA)")
    return load_extension().SwapInContext(*tables.extension_args())


def check_swap_in_cuda_args(
    top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor, tables: SwapInTables
) -> None:
    """`SwapInTables.check` (shapes, dtypes; ValueError) plus the CUDA path's devices and pinned host pool."""
    tables.check(top_k_tokens, seq_lens, req_rows)
    device = tables.device_pool.device
    if top_k_tokens.device != device or tables.buffer_tokens.device != device or tables.lru_order.device != device:
        raise ValueError(f"top_k_tokens, buffer_tokens and lru_order must be on {device}")
    if tables.buffer_slots.device != device or tables.host_rows.device != device:
        raise ValueError(f"buffer_slots and host_rows must be on {device}")
    if not tables.host_pool.is_cuda and not tables.host_pool.is_pinned():
        raise ValueError("host_pool must be pinned host memory (the GPU reads it directly through UVA)")
    if tables.counters is not None and tables.counters.device != device:
        raise ValueError(f"counters must be on {device}")
