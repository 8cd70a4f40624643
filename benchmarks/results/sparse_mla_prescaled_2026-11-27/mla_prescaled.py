"""Issue 23 item 6, prepared in session 20 (2026-11-27) without a GPU: the Triton sparse MLA kernel with FP8 rows
dequantized *with their scale* into bf16 ("prescaled"), so that the loop is the bf16 path's: one chained QK
accumulator and one bf16 P for the four PV dots, instead of four scaled QK dots and four scaled P tiles.

Why it is the same math: kernels/fp8_rows.py's scales are powers of two, so fp8 · scale is exact in bf16 and
(p · s).to(bf16) == p.to(bf16) · s (barring subnormals); QK differs from the current kernel only in the order of the
fp32 additions (one chained accumulator against four dots summed), so the outputs are not the current kernel's
bits but agree with the float reference as closely (`check_cpu.py`). HiSparse and dense would still share one kernel.

`SCALE_IN`: 0 = e4m3 → fp32, × scale, → q's dtype; 1 = e4m3 → q's dtype, × scale in it (exact either way in
bf16; in fp16 while in range). q may be fp16: Triton 3.6's CPU interpreter computes bf16 dots wrongly (a 16×16
bf16 dot is off by ~1e10 there), so `check_cpu.py` runs everything in fp16.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.sparse_mla_triton import D_QK, D_V, FP8_ROW_BYTES, LOG2E


@triton.jit
def _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, TILE: tl.constexpr, FP8: tl.constexpr,
          SCALE_IN: tl.constexpr, OUT: tl.constexpr):
    """One 128-wide latent tile of the gathered rows in q's dtype OUT [BLOCK_N, 128], already multiplied by its
    scale."""
    offs = tl.arange(0, 128)
    if FP8:
        raw = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None], other=0)
        scale = tl.load(kv_f32_ptr + rows * stride_f32 + 128 + TILE, mask=valid, other=0.0)
        if SCALE_IN == 0:
            vals = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(OUT)
        else:
            vals = raw.to(tl.float8e4nv, bitcast=True).to(OUT) * scale.to(OUT)[:, None]
    else:
        vals = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None],
                       other=0.0)
    return vals


@triton.jit
def _prescaled_kernel(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, idx_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_f32, stride_bf16, stride_ib,
    num_heads, top_k, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, SCALE_IN: tl.constexpr,
):
    """One program per (request, block of heads), the whole top-k list (no splits: the batch sizes it is for)."""
    pid = tl.program_id(0)
    head_blocks = num_heads // BLOCK_H
    b = pid // head_blocks
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs = tl.arange(0, 128)
    offs_r = tl.arange(0, 64)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    q0 = tl.load(q_rows + offs[None, :])
    q1 = tl.load(q_rows + 128 + offs[None, :])
    q2 = tl.load(q_rows + 256 + offs[None, :])
    q3 = tl.load(q_rows + 384 + offs[None, :])
    qr = tl.load(q_rows + 512 + offs_r[None, :])
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for tile in range(0, top_k // BLOCK_N):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + offs_n)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k0 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 0, FP8, SCALE_IN, q0.dtype)
        k1 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 1, FP8, SCALE_IN, q0.dtype)
        k2 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 2, FP8, SCALE_IN, q0.dtype)
        k3 = _tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 3, FP8, SCALE_IN, q0.dtype)
        if FP8:
            kr = tl.load(kv_bf16_ptr + rows[:, None] * stride_bf16 + 264 + offs_r[None, :], mask=valid[:, None],
                         other=0.0).to(q0.dtype)
        else:
            kr = tl.load(kv_ptr + rows[:, None] * stride_kv + 512 + offs_r[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(q0, tl.trans(k0))
        scores = tl.dot(q1, tl.trans(k1), scores)
        scores = tl.dot(q2, tl.trans(k2), scores)
        scores = tl.dot(q3, tl.trans(k3), scores)
        scores = tl.dot(qr, tl.trans(kr), scores)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pb = p.to(q0.dtype)
        acc0 = tl.dot(pb, k0, acc0 * alpha[:, None])
        acc1 = tl.dot(pb, k1, acc1 * alpha[:, None])
        acc2 = tl.dot(pb, k2, acc2 * alpha[:, None])
        acc3 = tl.dot(pb, k3, acc3 * alpha[:, None])
        m_i = m_new
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    bh = b.to(tl.int64) * num_heads + heads
    o_rows = out_ptr + bh[:, None] * 512
    tl.store(o_rows + offs[None, :], (acc0 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 128 + offs[None, :], (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 256 + offs[None, :], (acc2 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(o_rows + 384 + offs[None, :], (acc3 * inv[:, None]).to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh, tl.where(has, lse2 * 0.6931471805599453, float("inf")))


def sparse_mla_prescaled(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                         block_h: int = 64, block_n: int = 64, num_warps: int = 8, num_stages: int = 2,
                         scale_in: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, 576] bf16, kv [N, 656] uint8 FP8 rows or [N, 576] bf16, indices [B, K] int32 → out, lse."""
    batch, heads, _ = q.shape
    fp8 = kv.dtype == torch.uint8
    assert kv.shape[1] == (FP8_ROW_BYTES if fp8 else D_QK)
    out = torch.empty((batch, heads, D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads), dtype=torch.float32, device=q.device)
    kv_f32 = kv.view(torch.float32) if fp8 else kv
    kv_bf16 = kv.view(torch.bfloat16) if fp8 else kv
    indices = indices.to(torch.int32).contiguous()
    _prescaled_kernel[(batch * heads // block_h,)](
        q, kv, kv_f32, kv_bf16, indices, out, lse, q.stride(0), q.stride(1), kv.stride(0), kv_f32.stride(0),
        kv_bf16.stride(0), indices.stride(0), heads, indices.shape[1], float(scale) * LOG2E,
        BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, SCALE_IN=scale_in, num_warps=num_warps, num_stages=num_stages)
    return out, lse
