"""Dispatchers: the GPU implementation for CUDA tensors, the PyTorch reference otherwise.

GPU modules are imported lazily so that importing `kernels` needs neither Triton nor a CUDA toolkit.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from kernels.fp8_rows import FP8_ROW_BYTES, unpack_fp8_rows
from kernels.indexer_ref import indexer_topk_ref
from kernels.sparse_mla_ref import D_V, sparse_mla_decode_ref
from kernels.swap_in_ref import swap_in_ref
from kernels.swap_in_tables import SwapInTables


def swap_in(
    top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor, tables: SwapInTables,
    check: bool = True,
) -> torch.Tensor:  # fmt: skip
    """HiSparse swap-in of one batch against one layer's `tables` (semantics: kernels/swap_in_ref.py). CUDA kernel
    when the device pool is on a GPU (host pool pinned), the reference otherwise. `check=False`: see
    `swap_in_cuda` (the reference always checks). A caller that swaps in repeatedly against the same tables binds
    them once: `BoundSwapIn`."""
    if tables.device_pool.is_cuda:
        from kernels.swap_in_cuda import swap_in_cuda

        return swap_in_cuda(top_k_tokens, seq_lens, req_rows, tables, check=check)
    return swap_in_ref(top_k_tokens, seq_lens, req_rows, tables)


# The side-stream copy cap that follows the batch (`BoundSwapIn.max_copy_blocks = AUTO_COPY_BLOCKS`, the engine's
# `hisparse.side_stream_copy_blocks` default): one block per AUTO_COPY_REQUESTS_PER_BLOCK requests, within
# [AUTO_COPY_MIN_BLOCKS, AUTO_COPY_MAX_BLOCKS]. Why: a layer's misses grow with the batch and a layer's time hardly
# does, so a small batch's copies finish early with few blocks, and every block more holds an SM that the kernels
# beside it (one CTA an SM, sized to the whole GPU) then lose a partial wave to; 16 capped blocks already move
# rows as fast as the full grid. Measured on an H200 (docs/benchmarks.md, issue 23 item 3), the 20 % miss step
# against the 0 % one: glm5-rank-ep8 at batch 42 (32K) 1.13-1.14x with 8 blocks, 1.17-1.19x with 16;
# glm5-shared-bench (FP8 rows) at batch 64 8 and 16 blocks within 1 %, at batch 96 12 blocks 3-5 % ahead of both,
# at batch 128 16 blocks level with 8 or up to 4 % ahead (bf16 rows: 16 blocks 2 % ahead at batch 64 and 128).
AUTO_COPY_BLOCKS = "auto"
AUTO_COPY_REQUESTS_PER_BLOCK = 8
AUTO_COPY_MIN_BLOCKS = 8
AUTO_COPY_MAX_BLOCKS = 16


def auto_copy_blocks(batch: int) -> int:
    """The copy cap `AUTO_COPY_BLOCKS` gives a swap-in of `batch` requests (8 up to 64 requests, then one block
    per 8 requests, 16 from 121 on)."""
    wanted = -(-batch // AUTO_COPY_REQUESTS_PER_BLOCK)
    return max(AUTO_COPY_MIN_BLOCKS, min(AUTO_COPY_MAX_BLOCKS, wanted))


class BoundSwapIn:
    """`swap_in` for one layer with its tables bound once: `bound(top_k_tokens, seq_lens, req_rows)` equals
    `swap_in(top_k_tokens, seq_lens, req_rows, bound.tables)`.

    Why: the HiSparse backend swaps in once per layer per decode step, and without CUDA graphs that host time is on
    the step's critical path. On the GPU the call goes straight to the extension's `SwapInContext` (three tensors
    converted, no UVA lookup, no per-call Python beyond this method); the argument checks (ValueErrors) run on the
    first call of each top-k shape only, since the bound tables are the same for every call. On the CPU it calls
    the reference, which checks every call. The bound tensors must not be resized or re-pointed while it lives."""

    def __init__(self, tables: SwapInTables) -> None:
        self.tables = tables
        self._max_copy_blocks: int | str = 0
        self._applied_copy_blocks = 0  # the cap the extension holds now (AUTO_COPY_BLOCKS: set per batch)
        self._context = None
        self._checked_shapes: set[tuple] = set()
        self._check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]
        self._run: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
        if tables.device_pool.is_cuda:
            from kernels.swap_in_cuda import bind_swap_in_cuda, check_swap_in_cuda_args

            self._check = partial(check_swap_in_cuda_args, tables=tables)
            self._context = bind_swap_in_cuda(tables)  # the extension's SwapInContext
            self._run = self._context
        else:
            self._check = tables.check
            self._run = partial(swap_in_ref, tables=tables)

    @property
    def max_copy_blocks(self) -> int | str:
        """Cap on the CUDA copy kernel's blocks: 0 for its default grid, a block count, or `AUTO_COPY_BLOCKS` (the
        cap `auto_copy_blocks` gives each call's batch). A swap-in that runs on a side stream beside other kernels
        takes a cap: its copy waits on PCIe, and a capped grid keeps 4 rows a warp in flight, so 16 blocks keep the
        link as busy as the full grid while leaving the other SMs to its neighbours. Results never depend on it;
        the CPU reference has no grid and ignores it."""
        return self._max_copy_blocks

    @max_copy_blocks.setter
    def max_copy_blocks(self, blocks: int | str) -> None:
        if blocks != AUTO_COPY_BLOCKS and (isinstance(blocks, str) or int(blocks) < 0):
            raise ValueError(f"max_copy_blocks must be >= 0 or {AUTO_COPY_BLOCKS!r}, got {blocks!r}")
        self._max_copy_blocks = blocks if blocks == AUTO_COPY_BLOCKS else int(blocks)
        if isinstance(self._max_copy_blocks, int):
            self._apply_copy_blocks(self._max_copy_blocks)

    def _apply_copy_blocks(self, blocks: int) -> None:
        self._applied_copy_blocks = blocks
        if self._context is not None:
            self._context.max_copy_blocks = blocks

    def __call__(self, top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor) -> torch.Tensor:
        # Checked once per signature (shape, dtype and device of each argument), not just per top-k shape: every
        # argument the extension would refuse is refused here first, with a ValueError. The extension's own
        # checks stay as a second line, but an exception raised inside it has crashed the process on the GPU
        # (a seq_lens of the wrong length, 2026-11-23; cause not established), so it must not be the first.
        signature = tuple((t.shape, t.dtype, t.device) for t in (top_k_tokens, seq_lens, req_rows))
        if signature not in self._checked_shapes:
            self._check(top_k_tokens, seq_lens, req_rows)
            self._checked_shapes.add(signature)
        if self._max_copy_blocks == AUTO_COPY_BLOCKS:
            blocks = auto_copy_blocks(top_k_tokens.shape[0])
            if blocks != self._applied_copy_blocks:
                self._apply_copy_blocks(blocks)
        return self._run(top_k_tokens, seq_lens, req_rows)


# Query rows per reference call: bounds the gathered rows (chunk × K × D fp32) so a long prefill's memory grows
# with the prompt only through its outputs, not through K gathered rows per token (64 MiB per chunk at most).
REF_GATHER_BUDGET_BYTES = 64 << 20


def reference_chunk_rows(top_k: int, row_width: int) -> int:
    """How many query rows one reference call takes so its float32 gather stays within the budget."""
    return max(1, REF_GATHER_BUDGET_BYTES // max(1, top_k * row_width * 4))


def sparse_mla_decode_rows_ref(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int = D_V
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference over either row format (float rows of any width; values = the first `d_v` entries). FP8 rows
    are gathered first and only the selected ones unpacked, so the cost does not grow with the pool. Query rows
    go through in chunks (`reference_chunk_rows`); each row's result depends only on its own q and selection."""
    if kv.dtype == torch.uint8 and (kv.dim() != 2 or kv.shape[1] != FP8_ROW_BYTES):
        raise ValueError(f"uint8 KV rows must be [N, {FP8_ROW_BYTES}], got {tuple(kv.shape)}")
    chunk = reference_chunk_rows(indices.shape[-1], q.shape[-1])
    if indices.dim() != 2 or indices.shape[0] <= chunk:
        return _rows_ref_one_call(q, kv, indices, scale, d_v)
    parts = [_rows_ref_one_call(q[i : i + chunk], kv, indices[i : i + chunk], scale, d_v)
             for i in range(0, indices.shape[0], chunk)]
    return torch.cat([o for o, _ in parts]), torch.cat([lse for _, lse in parts])


def _rows_ref_one_call(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if kv.dtype != torch.uint8:
        return sparse_mla_decode_ref(q, kv, indices, scale, d_v)
    batch, top_k = indices.shape
    valid = indices >= 0
    rows = unpack_fp8_rows(kv[torch.where(valid, indices, 0).reshape(-1).long()])
    local = torch.arange(batch * top_k, device=indices.device, dtype=torch.int32).reshape(batch, top_k)
    return sparse_mla_decode_ref(q, rows, torch.where(valid, local, -1), scale, d_v)


ATTENTION_KERNELS = ("triton", "flashmla")


def sparse_mla_decode(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, d_v: int = D_V, *, kernel: str = "triton"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode: q [B, H, 576], kv [N, 576] float rows or [N, 656] uint8 FP8 rows, indices [B, K]
    int32 (−1 skip) → (out [B, H, 512] in q's dtype, lse [B, H] fp32, natural log).

    On CUDA: `kernel="triton"` runs our own kernel: on Hopper the Gluon one where it takes the launch
    (kernels/sparse_mla_gluon.py: bf16 q, 64 or 128 heads, a TP rank's 32, and 16 with FP8 rows), the Triton one
    otherwise; `"flashmla"` runs FlashMLA where it takes the shapes and is the faster one at this batch
    (`sparse_mla_plan.prefer_flashmla`), our own kernel otherwise. The choice depends on the device and shapes
    only, never on slot placement. All take 576 / 512 only: the engine refuses other sizes at load
    (decode_server/engine/kernel_support.py). Elsewhere: the reference, for any row width and value width `d_v`."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {ATTENTION_KERNELS}")
    if q.is_cuda:
        if kernel == "flashmla":
            from kernels.sparse_mla_flashmla import flashmla_applies, sparse_mla_decode_flashmla
            from kernels.sparse_mla_plan import prefer_flashmla

            if flashmla_applies(q, kv, indices) and prefer_flashmla(q.shape[0], q.shape[1], kv.dtype == torch.uint8):
                return sparse_mla_decode_flashmla(q, kv, indices, scale)
        from kernels.sparse_mla_gluon import gluon_applies, sparse_mla_decode_gluon

        if gluon_applies(q, kv, indices):
            return sparse_mla_decode_gluon(q, kv, indices, scale)
        from kernels.sparse_mla_triton import sparse_mla_decode_triton

        return sparse_mla_decode_triton(q, kv, indices, scale)
    return sparse_mla_decode_rows_ref(q, kv, indices, scale, d_v)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    tables_ready: bool = False,
) -> torch.Tensor:
    """Lightning-indexer top-k (semantics and arguments: kernels/indexer_ref.py). The Triton kernels on CUDA.
    tables_ready: token_rows, token_req and seq_lens were written before the kernel launched just before this call
    (the engine: before the layer), so the scores kernel may read them while that kernel still runs
    (kernels/indexer_fast.py); it changes no result."""
    if q.is_cuda:
        from kernels.indexer_gpu import indexer_topk_batched

        return indexer_topk_batched(q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, top_k,
                                    tables_ready=tables_ready)
    return indexer_topk_ref(q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, top_k)


def write_index_rows(keys_dst: torch.Tensor, scales_dst: torch.Tensor, rows: torch.Tensor, keys_fp8: torch.Tensor,
                     scales: torch.Tensor) -> None:
    """The index-key write of a layer: keys_dst[rows] = keys_fp8, scales_dst[rows] = scales (float32), rows >= 0.
    One Triton kernel on CUDA (`kernels.indexer_fast.write_index_rows`: it also lets the scores kernel after it
    start early; it skips negative rows as a guard), indexed assignments elsewhere; the same bytes either way."""
    if keys_dst.is_cuda:
        from kernels.indexer_gpu import triton_available

        if triton_available():
            from kernels.indexer_fast import write_index_rows as write_index_rows_triton

            write_index_rows_triton(keys_dst, scales_dst, rows, keys_fp8, scales)
            return
    keys_dst[rows] = keys_fp8
    scales_dst[rows] = scales.float()


def backup_rows(
    device_pool: torch.Tensor,
    host_pool: torch.Tensor,
    src_slots: torch.Tensor,
    dst_rows: torch.Tensor,
    stream: torch.cuda.Stream | None = None,
) -> torch.cuda.Event | None:
    """Copy rows `device_pool[:, src_slots[i]]` → `host_pool[:, dst_rows[i]]` for all layers.

    device_pool [L, N_dev, row_bytes] uint8, host_pool [L, N_host, row_bytes] uint8 (pinned on GPU systems).
    On CUDA: one kernel launch on `stream` (a side stream; by default a module-wide one) after the current
    stream's work, returning the event to wait on (`torch.cuda.current_stream().wait_event(ev)`).
    On CPU: the copy is done synchronously and None is returned.
    """
    if device_pool.dim() != 3 or host_pool.dim() != 3 or device_pool.shape[0] != host_pool.shape[0] or (
        device_pool.shape[2] != host_pool.shape[2]
    ):
        raise ValueError(
            f"expected device_pool [L, N_dev, B] and host_pool [L, N_host, B], got {tuple(device_pool.shape)}, "
            f"{tuple(host_pool.shape)}"
        )
    if src_slots.shape != dst_rows.shape or src_slots.dim() != 1:
        raise ValueError("src_slots and dst_rows must be equal-length 1-D tensors")
    if device_pool.is_cuda:
        from kernels.backup_cuda import backup_rows_cuda

        return backup_rows_cuda(device_pool, host_pool, src_slots, dst_rows, stream)
    if src_slots.numel():
        host_pool[:, dst_rows.long()] = device_pool[:, src_slots.long()].to(host_pool.device)
    return None


def copy_rows(src_pool: torch.Tensor, dst_pool: torch.Tensor, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """`dst_pool[:, dst_rows[i]] = src_pool[:, src_rows[i]]` for every layer; pools [L, N, row_bytes] uint8.

    When either pool is on a GPU: one asynchronous kernel launch on the current stream (the other pool on that
    GPU or pinned host memory, kernels/copy_rows_cuda.py). Otherwise a synchronous PyTorch copy (the reference).
    """
    if src_pool.dim() != 3 or dst_pool.dim() != 3 or src_pool.shape[0] != dst_pool.shape[0] or (
        src_pool.shape[2] != dst_pool.shape[2]
    ):
        raise ValueError(f"expected pools [L, N_src, B] and [L, N_dst, B], got {tuple(src_pool.shape)}, "
                         f"{tuple(dst_pool.shape)}")
    if src_rows.shape != dst_rows.shape or src_rows.dim() != 1:
        raise ValueError("src_rows and dst_rows must be equal-length 1-D tensors")
    if src_pool.is_cuda or dst_pool.is_cuda:
        from kernels.copy_rows_cuda import copy_rows_cuda

        copy_rows_cuda(src_pool, dst_pool, src_rows, dst_rows)
        return
    if src_rows.numel():
        dst_pool[:, dst_rows.long()] = src_pool[:, src_rows.long()]
