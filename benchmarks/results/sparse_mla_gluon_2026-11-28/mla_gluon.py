"""Issue 23 item 6, prepared 2026-11-28 without a GPU: the sparse MLA decode (bf16 rows) written in Gluon so that
the softmax of one tile runs on the CUDA cores while the tensor cores compute the next tile's scores.

Why: ncu on the Triton kernel (docs/benchmarks-history.md, 2026-11-27) found one 8-warp program an SM whose loads,
softmax and MMAs take turns (tensor pipe 40 % busy). Triton 3.6 issues each `tl.dot` and waits for it at once.
Here every wgmma is issued asynchronously and waited for explicitly:

    for tile t:   issue the gathers of tile t + STAGES − 1 (cp.async, one commit group a tile)
                  wait for tile t + 1's group; issue S' = q · K(t+1)ᵀ (five wgmmas, not waited)
                  softmax of S (tile t) → P, rescale the accumulators          ← overlaps S'
                  P → shared memory; issue acc += P · V(t) (four wgmmas)
                  wait for all (S', acc); S = S'

Same math and order as kernels/sparse_mla_triton.py (one chained QK accumulator over the four latent tiles then the
RoPE tile, base-2 online softmax, P in bf16, PV per 128-wide tile), but with BLOCK_N 32 (a ring of STAGES tiles
fits beside q in shared memory); so results are close to, not bit-equal with, the Triton kernel's. One program per
(request, 64 heads, split), 8 warps (two warp groups splitting each tile's columns), writing the Triton kernel's
outputs or its split partials (its combine kernel merges them).
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    warpgroup_mma,
    warpgroup_mma_wait,
)

D_V = 512
LOG2E = 1.4426950408889634


@gluon.jit
def _issue_tile(kn_ring, kr_ring, kv_ptr, idx_ptr, b, tile, end_tile, top_k, stride_kv, stride_ib,
                STAGES: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """cp.async gathers of one tile's rows (four 128-wide latent chunks and the 64-wide RoPE part) into its ring
    slot, as one commit group. Entries −1 and tiles past the split are zero-filled (masked)."""
    wide: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    narrow: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    stage = tile % STAGES
    offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, wide))
    in_range = (offs_n < top_k) & (tile < end_tile)
    idx = gl.load(idx_ptr + b.to(gl.int64) * stride_ib + offs_n, mask=in_range, other=-1)
    valid = idx >= 0
    rows = gl.where(valid, idx, 0).to(gl.int64)
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, wide))
    base = kv_ptr + rows[:, None] * stride_kv + cols[None, :]
    for j in gl.static_range(4):
        async_copy.async_copy_global_to_shared(kn_ring.index(stage * 4 + j), base + j * 128, mask=valid[:, None])
    offs_nr = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, narrow))
    in_range_r = (offs_nr < top_k) & (tile < end_tile)
    idx_r = gl.load(idx_ptr + b.to(gl.int64) * stride_ib + offs_nr, mask=in_range_r, other=-1)
    valid_r = idx_r >= 0
    rows_r = gl.where(valid_r, idx_r, 0).to(gl.int64)
    cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, narrow))
    async_copy.async_copy_global_to_shared(kr_ring.index(stage), kv_ptr + rows_r[:, None] * stride_kv + 512
                                           + cols_r[None, :], mask=valid_r[:, None])
    async_copy.commit_group()


@gluon.jit
def _issue_scores(q_smem, qr_smem, kn_ring, kr_ring, stage, s_layout: gl.constexpr, BLOCK_H: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """S = q · K(stage)ᵀ over the four latent chunks then the RoPE part, issued, not waited for."""
    s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
    s = warpgroup_mma(q_smem.index(0), kn_ring.index(stage * 4 + 0).permute((1, 0)), s, use_acc=False,
                      is_async=True)
    for j in gl.static_range(1, 4):
        s = warpgroup_mma(q_smem.index(j), kn_ring.index(stage * 4 + j).permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(qr_smem, kr_ring.index(stage).permute((1, 0)), s, is_async=True)
    return s


@gluon.jit
def _softmax_and_pv(s, m_i, l_i, acc0, acc1, acc2, acc3, p_smem, kn_ring, idx_ptr, b, tile, stride_ib, scale_log2,
                    offs_s, o_layout: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    LAZY_RESCALE: gl.constexpr, P_REGS: gl.constexpr):
    """Online softmax of one tile's scores, the accumulators' rescale, and its four PV wgmmas issued (not waited
    for). P_REGS: P is the wgmmas' A operand in registers (needs DUP_QK: each warp group holds whole rows of P),
    so no shared-memory round trip and no barrier; otherwise P goes through shared memory."""
    idx = gl.load(idx_ptr + b.to(gl.int64) * stride_ib + tile * BLOCK_N + offs_s)
    valid = idx >= 0
    scores = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=1))
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_safe)
    p = gl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    m_i = m_new
    if P_REGS:
        p_op = gl.convert_layout(p.to(gl.bfloat16), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    else:
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()
        p_op = p_smem
    if LAZY_RESCALE:
        # Multiplying by an alpha of exactly 1 changes nothing, so skip the 4 × [64, 128] multiply when no
        # row's maximum moved (bit-identical; after the first tiles the running maxima rarely move).
        moved = gl.max(gl.where(alpha < 1.0, 1, 0), axis=0)
        if moved > 0:
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc0 = acc0 * alpha_o
            acc1 = acc1 * alpha_o
            acc2 = acc2 * alpha_o
            acc3 = acc3 * alpha_o
    else:
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc0 = acc0 * alpha_o
        acc1 = acc1 * alpha_o
        acc2 = acc2 * alpha_o
        acc3 = acc3 * alpha_o
    stage = tile % STAGES
    acc0 = warpgroup_mma(p_op, kn_ring.index(stage * 4 + 0), acc0, is_async=True)
    acc1 = warpgroup_mma(p_op, kn_ring.index(stage * 4 + 1), acc1, is_async=True)
    acc2 = warpgroup_mma(p_op, kn_ring.index(stage * 4 + 2), acc2, is_async=True)
    acc3 = warpgroup_mma(p_op, kn_ring.index(stage * 4 + 3), acc3, is_async=True)
    return m_i, l_i, acc0, acc1, acc2, acc3


@gluon.jit
def _sparse_mla_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_ib, num_heads, top_k, scale_log2,
    BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, TOKENS_PER_SPLIT: gl.constexpr,
    NUM_SPLITS: gl.constexpr, DUP_QK: gl.constexpr, LAZY_RESCALE: gl.constexpr, CLASSIC: gl.constexpr,
    P_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    TILES: gl.constexpr = TOKENS_PER_SPLIT // BLOCK_N
    pid = gl.program_id(0)
    split = gl.program_id(1)
    head_blocks = num_heads // BLOCK_H
    b = pid // head_blocks
    h0 = (pid % head_blocks) * BLOCK_H

    # Layouts: the scores [BLOCK_H, BLOCK_N] and each accumulator [BLOCK_H, 128] split over two warp groups by
    # columns; shared tiles in the wgmma's swizzled layout.
    if DUP_QK:  # both warp groups compute the whole score tile (twice the QK MMAs, no cross-group reductions)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
    else:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, BLOCK_N // (num_warps // 4), 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                       instr_shape=[16, 128 // (num_warps // 4), 16])
    wide_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    narrow_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    q_wide: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    q_narrow: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], wide_smem)
    qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], narrow_smem)
    kn_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES * 4, BLOCK_N, 128], wide_smem)
    kr_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], narrow_smem)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_smem_layout)

    # The first STAGES − 1 tiles' gathers, then q (its load overlaps them).
    start_tile = split * TILES
    for t in gl.static_range(STAGES - 1):
        _issue_tile(kn_ring, kr_ring, kv_ptr, idx_ptr, b, start_tile + t, start_tile + TILES, top_k, stride_kv,
                    stride_ib, STAGES, BLOCK_N, num_warps)
    heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_wide))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, q_wide))
    q_rows = q_ptr + b.to(gl.int64) * stride_qb + heads[:, None] * stride_qh
    for j in gl.static_range(4):
        q_smem.index(j).store(gl.load(q_rows + j * 128 + cols[None, :]))
    heads_r = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_narrow))
    cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, q_narrow))
    qr_smem.store(gl.load(q_ptr + b.to(gl.int64) * stride_qb + heads_r[:, None] * stride_qh + 512 + cols_r[None, :]))
    fence_async_shared()

    acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
    acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
    acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
    acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))

    offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    if CLASSIC:
        # Classic order: the gathers of tile t + STAGES − 1 are issued first and land while tile t's scores,
        # softmax and PV run (the overlap order below waits for tile t + 1's gathers right after issuing them
        # when STAGES is 2).
        for t in range(0, TILES):
            tile = start_tile + t
            _issue_tile(kn_ring, kr_ring, kv_ptr, idx_ptr, b, tile + STAGES - 1, start_tile + TILES, top_k,
                        stride_kv, stride_ib, STAGES, BLOCK_N, num_warps)
            async_copy.wait_group(STAGES - 1)
            fence_async_shared()
            gl.thread_barrier()
            s = _issue_scores(q_smem, qr_smem, kn_ring, kr_ring, tile % STAGES, s_layout, BLOCK_H, BLOCK_N)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_and_pv(
                s, m_i, l_i, acc0, acc1, acc2, acc3, p_smem, kn_ring, idx_ptr, b, tile, stride_ib, scale_log2,
                offs_s, o_layout, BLOCK_N, STAGES, LAZY_RESCALE, P_REGS)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            gl.thread_barrier()
    else:
        # Tile 0's scores.
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        s = _issue_scores(q_smem, qr_smem, kn_ring, kr_ring, start_tile % STAGES, s_layout, BLOCK_H, BLOCK_N)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        for t in range(0, TILES):
            tile = start_tile + t
            # Gathers of tile t + STAGES − 1 into the slot tile t − 1 freed (its PV was waited for, then a
            # barrier).
            _issue_tile(kn_ring, kr_ring, kv_ptr, idx_ptr, b, tile + STAGES - 1, start_tile + TILES, top_k,
                        stride_kv, stride_ib, STAGES, BLOCK_N, num_warps)
            # Tile t + 1 landed (at most STAGES − 2 newer groups outstanding): issue its scores, do not wait.
            async_copy.wait_group(STAGES - 2)
            fence_async_shared()
            gl.thread_barrier()
            s_next = _issue_scores(q_smem, qr_smem, kn_ring, kr_ring, (tile + 1) % STAGES, s_layout, BLOCK_H,
                                   BLOCK_N)
            # Softmax of tile t beside them, then its PV.
            m_i, l_i, acc0, acc1, acc2, acc3 = _softmax_and_pv(
                s, m_i, l_i, acc0, acc1, acc2, acc3, p_smem, kn_ring, idx_ptr, b, tile, stride_ib, scale_log2,
                offs_s, o_layout, BLOCK_N, STAGES, LAZY_RESCALE, P_REGS)
            s, acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, acc0, acc1, acc2, acc3))
            gl.thread_barrier()
    async_copy.wait_group(0)

    has = l_i > 0.0
    inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    inv_o = gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
    heads_o = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
    cols_o = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    bh_o = b.to(gl.int64) * num_heads + heads_o
    heads_s = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
    bh_s = b.to(gl.int64) * num_heads + heads_s
    if NUM_SPLITS == 1:
        o_rows = out_ptr + bh_o[:, None] * 512 + cols_o[None, :]
        gl.store(o_rows, (acc0 * inv_o).to(gl.bfloat16))
        gl.store(o_rows + 128, (acc1 * inv_o).to(gl.bfloat16))
        gl.store(o_rows + 256, (acc2 * inv_o).to(gl.bfloat16))
        gl.store(o_rows + 384, (acc3 * inv_o).to(gl.bfloat16))
        gl.store(lse_ptr + bh_s, gl.where(has, lse2 * 0.6931471805599453, float("inf")))
    else:
        part_o = bh_o * NUM_SPLITS + split
        p_rows = part_out_ptr + part_o[:, None] * 512 + cols_o[None, :]
        gl.store(p_rows, acc0 * inv_o)
        gl.store(p_rows + 128, acc1 * inv_o)
        gl.store(p_rows + 256, acc2 * inv_o)
        gl.store(p_rows + 384, acc3 * inv_o)
        gl.store(part_lse_ptr + bh_s * NUM_SPLITS + split, lse2)


def sparse_mla_gluon(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float, splits: int = 1,
                     block_n: int = 32, stages: int = 3, dup_qk: bool = False,
                     lazy_rescale: bool = False, classic: bool = False,
                     p_regs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, H, 576] bf16, kv [N, 576] bf16, indices [B, K] int32 (−1 = skip) → out [B, H, 512], lse [B, H] (the
    Triton kernel's contract; `splits` partials merged by its combine kernel)."""
    from kernels.sparse_mla_triton import _combine_kernel

    batch, heads, _ = q.shape
    top_k = indices.shape[1]
    assert kv.dtype == torch.bfloat16 and kv.shape[1] == 576 and q.dtype == torch.bfloat16
    assert heads % 64 == 0 and top_k % (block_n * splits) == 0
    assert dup_qk or not p_regs, "P in registers needs whole rows of P in each warp group (dup_qk)"
    indices = indices.to(torch.int32).contiguous()
    q = q.contiguous()
    out = torch.empty((batch, heads, D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, heads), dtype=torch.float32, device=q.device)
    if splits > 1:
        part_out = torch.empty((batch, heads, splits, D_V), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, lse
    _sparse_mla_gluon_kernel[(batch * heads // 64, splits)](
        q, kv, indices, out, lse, part_out, part_lse, q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
        heads, top_k, float(scale) * LOG2E, BLOCK_H=64, BLOCK_N=block_n, STAGES=stages,
        TOKENS_PER_SPLIT=top_k // splits, NUM_SPLITS=splits, DUP_QK=dup_qk,
        LAZY_RESCALE=lazy_rescale, CLASSIC=classic, P_REGS=p_regs, num_warps=8)
    if splits > 1:
        _combine_kernel[(batch * heads,)](part_out, part_lse, out, lse, NUM_SPLITS=splits,
                                          SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
    return out, lse
