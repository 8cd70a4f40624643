"""Issue 23 item 1, prepared in session 20 (2026-11-27) without a GPU: the indexer scores kernel with each block's
keys and scales brought by TMA from the engine's paged pool.

The engine's token table maps a request's 64-position blocks to pages of 64 consecutive pool rows (page size 64,
kernels/indexer_fast.py's BLOCK_N), so a block's 128-byte key rows are one contiguous 8 KB run and its scales one
256-byte run: the kernel loads only the block's first row id and asks for the two runs with TMA descriptor loads.
Against kernels/indexer_fast.py's `_scores_kernel` (e4m3 q only, Q_E4M3): no per-thread gather addresses and
masks, and the scales come through the pipeline instead of the synchronous look-ahead loads. Same dot, same
epilogue: the scores are the same bits wherever the table is paged (`check_cpu.py`). A block whose first row id
is < 0 scores 0, as unallocated rows do in the gather kernel. In the engine it would apply where `--page-size` is a
multiple of 64 (the default is 64: pages start on multiples of 64 rows, so the TMA boxes are aligned); other page
sizes keep the gather kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.indexer_fast import _RESIDENT, _RESIDENT_GUESS, _resident_programs, blocks_per_program


@triton.jit(do_not_specialize=["max_len", "blocks_per_prog", "stride_rows_b"])
def _paged_scores_kernel(
    q_ptr, w_ptr, keys_desc, scales_desc, rows_ptr, req_ptr, lens_ptr, out_ptr,
    stride_qt, stride_qh, stride_wt, stride_rows_b, stride_rows_l, stride_out,
    num_heads, max_len, blocks_per_prog,
    HEADS_P: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # launched with programmatic dependent launch: start early, read nothing before the previous kernel ends
        tl.extra.cuda.gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    span = tl.program_id(1)
    req = tl.load(req_ptr + t).to(tl.int64)
    seq_len = tl.minimum(tl.load(lens_ptr + t).to(tl.int64), max_len).to(tl.int32)
    start = span * blocks_per_prog * BLOCK_N
    scored_end = tl.minimum(tl.minimum(start + blocks_per_prog * BLOCK_N, max_len), seq_len)
    if scored_end > start:
        heads = tl.arange(0, HEADS_P)
        dims = tl.arange(0, 128)
        offs = tl.arange(0, BLOCK_N)
        head_ok = heads < num_heads
        w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
        q_at = q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :]
        q_op = tl.trans(tl.load(q_at, mask=head_ok[:, None], other=0).to(tl.float8e4nv, bitcast=True))
        row_base = rows_ptr + req * stride_rows_b
        out_base = out_ptr + t * stride_out
        num_blocks = (scored_end - start + BLOCK_N - 1) // BLOCK_N
        for i in range(0, num_blocks):
            pos0 = start + i * BLOCK_N
            row0 = tl.load(row_base + pos0 * stride_rows_l)
            first = tl.maximum(row0, 0)
            raw = keys_desc.load([first, 0])  # [BLOCK_N, 128] uint8: the page's key rows
            key_scale = scales_desc.load([first])  # [BLOCK_N] float32
            logits = tl.dot(raw.to(tl.float8e4nv, bitcast=True), q_op)  # [BLOCK_N, HEADS_P]
            score = tl.sum(tl.maximum(logits, 0.0) * w[None, :], axis=1) * key_scale
            score = tl.where(row0 >= 0, score, 0.0)
            pos = pos0 + offs
            tl.store(out_base + pos, score, mask=pos < scored_end)


def paged_scores(q8: torch.Tensor, w8: torch.Tensor, keys_fp8: torch.Tensor, scales: torch.Tensor,
                 token_rows: torch.Tensor, token_req: torch.Tensor, seq_lens: torch.Tensor, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 5, pdl: bool = False) -> torch.Tensor:
    """fp32 scores [T, L] like `indexer_scores_fast` on the e4m3 query `quantize_query` made; token_rows must be
    paged (each aligned block of `block_n` positions on `block_n` consecutive rows). `pdl` (CUDA only): launch with
    programmatic dependent launch, the kernel waiting for the previous one before its first load, so that only its
    launch overlaps the previous kernel's end (no read can see stale data)."""
    num_q, heads, _ = q8.shape
    max_len = token_rows.shape[1]
    padded = triton.cdiv(max(max_len, 1), 64) * 64
    out = torch.empty((num_q, padded), dtype=torch.float32, device=q8.device)[:, :max_len]
    if num_q == 0 or max_len == 0:
        return out
    keys_desc = TensorDescriptor.from_tensor(keys_fp8.view(torch.uint8), [block_n, 128])
    scales_desc = TensorDescriptor.from_tensor(scales, [block_n])
    device_index = q8.device.index if q8.device.index is not None else 0
    pdl = pdl and q8.is_cuda
    key = ("paged", block_n, num_warps, num_stages, pdl, device_index)
    launch = {"launch_pdl": True} if pdl else {}
    per_prog = blocks_per_program(num_q, max_len, block_n, q8.device, _RESIDENT.get(key, _RESIDENT_GUESS))
    grid = (num_q, triton.cdiv(max_len, per_prog * block_n))
    kernel = _paged_scores_kernel[grid](
        q8.view(torch.uint8), w8, keys_desc, scales_desc, token_rows, token_req, seq_lens, out,
        q8.stride(0), q8.stride(1), w8.stride(0), token_rows.stride(0), token_rows.stride(1), out.stride(0),
        heads, max_len, per_prog, HEADS_P=max(16, triton.next_power_of_2(heads)), BLOCK_N=block_n, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **launch,
    )
    if q8.is_cuda and key not in _RESIDENT and hasattr(kernel, "metadata"):
        _RESIDENT[key] = _resident_programs(kernel, num_warps, device_index)
    return out
