"""Sparse MLA decode for Hopper (sm_90) in Gluon: the `triton` attention backend's kernel where wgmma exists.

Same contract as kernels/sparse_mla_triton.py: q [B, H, 576] bf16, KV rows [N, 576] bf16 or [N, 656] uint8 FP8
rows (kernels/fp8_rows.py), indices [B, K] int32 (−1 = skip) → out [B, H, 512] bf16, lse [B, H] fp32 (natural log;
all-skipped: 0 and +inf). Same math as the Triton kernel (chained QK over the four latent tiles then RoPE, base-2
online softmax, P in bf16, PV per 128-wide tile), so results are close to it, not bit-equal.

Why a second kernel: Triton 3.6 waits for every `tl.dot` where it is issued and cannot overlap a tile's gathers
with the previous tile's work in one 8-warp program an SM (ncu, 2026-11-27: tensor pipe 40 % busy). Gluon exposes
the pieces: each tile's rows are gathered with cp.async into a two-slot ring one tile ahead, so they land while the
current tile's scores, softmax and PV run (benchmarks/results/sparse_mla_gluon_2026-11-28: 0.62× FlashMLA's time
against the Triton kernel's 0.47× at batch 64 on an H200; issuing the next tile's scores before the softmax instead
was slower, since with two slots it exposes the gathers). Each tile's index entries are loaded one tile before its
gathers are issued, and the softmax's mask entries one tile before its scores: loaded where they are used, their
global-memory latency was paid every tile (benchmarks/results/sparse_mla_gluon_prefetch_2026-11-28: 6–10 % faster,
same bits; bf16 0.68×, FP8 0.62× FlashMLA's time at batch 64 on an H200).

FP8 rows: a slot holds the gathered e4m3 bytes, the four scales and the bf16 RoPE part; each tile is dequantized
(e4m3 → fp32 × its power-of-two scale → bf16, exact) from its slot into one bf16 tile that the wgmmas read. With
q (72 KiB), the bf16 tile (64 KiB), two FP8 slots (2 × 41 KiB) and P (8 KiB) this fills an SM's 227 KiB. (Doing
the next tile's dequantization chunk by chunk beside the PV wgmmas gained nothing measurable on an H100; nor did
building the bf16 bits with integer ops instead of the e4m3 → f16 → f32 conversions, same bits, 1 % slower: the
dequantization is latency-, not conversion-bound.)

One program per (request, 64 heads, split of the top-k list), 8 warps: two warp groups splitting each tile's
columns. Splits write fp32 partials that the Triton kernel's combine kernel merges. A tensor-parallel rank's 16 or
32 heads run as one 64-head program, q's rows past the heads loaded as zeros and their outputs not stored
(`gluon_takes_heads`; FlashMLA and vLLM pad the same way).
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels.sparse_mla_plan import choose_splits

try:  # Gluon ships with Triton ≥ 3.5; without it the Triton kernel runs everywhere
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    GLUON_AVAILABLE = False

LOG2E = 1.4426950408889634
D_QK = 576
D_V = 512
FP8_ROW_BYTES = 656
BLOCK_H = 64
BLOCK_N = 64
NUM_WARPS = 8
STAGES = 2
PADDED_HEADS = (16, 32)  # a TP rank's heads of a 128-head model, run as one 64-head program (`PAD_HEADS`)


@functools.lru_cache(maxsize=8)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def gluon_takes_heads(num_heads: int, fp8: bool) -> bool:
    """Head counts `sparse_mla_decode` runs the Gluon kernel for: multiples of 64, and a tensor-parallel rank's 32
    heads (TP 4 of a 128-head model) or, with FP8 rows, 16 (TP 8), padded to one 64-head program a request. At
    those head counts attention is bound by the row gathers, so the padded MMAs cost little. Against the Triton
    kernel (B 1-256, H100 and H200, benchmarks/results/sparse_mla_tp_heads_2026-11-28): FP8 rows 1.10-1.35x
    faster at 16 heads and 1.08-3.07x at 32, bf16 rows 1.03-1.32x at 32; bf16 rows at 16 heads stay on the Triton
    kernel (0.84-1.07x: slower from batch 48 on the H200)."""
    if num_heads in PADDED_HEADS:
        return fp8 or num_heads == 32
    return num_heads > 0 and num_heads % BLOCK_H == 0


def gluon_applies(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    """Whether `sparse_mla_decode` runs the Gluon kernel for this launch: it can (`gluon_can_run`) and the head
    count is one it is the faster kernel for (`gluon_takes_heads`). Depends on the device and shapes only (the
    alignment holds for every pool the engine allocates: torch's allocations, rows of a multiple of 16 bytes), so
    dense and HiSparse runs (same shapes) always take the same kernel."""
    return gluon_can_run(q, kv, indices) and gluon_takes_heads(q.shape[1], kv.dtype == torch.uint8)


def gluon_can_run(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor) -> bool:
    """Whether the Gluon kernel takes this launch at all: a Hopper GPU, bf16 q with a multiple of 64 heads or 16 /
    32 (padded), 576-wide bf16 rows or 656-byte FP8 rows starting 16-byte aligned, a multiple of 64 selected rows."""
    if not (GLUON_AVAILABLE and q.is_cuda and _is_hopper(q.device.index or 0)):
        return False
    if q.dim() != 3 or q.shape[2] != D_QK or q.dtype != torch.bfloat16:
        return False
    if q.shape[1] % BLOCK_H and q.shape[1] not in PADDED_HEADS:
        return False
    if indices.dim() != 2 or indices.shape[1] == 0 or indices.shape[1] % BLOCK_N or kv.dim() != 2:
        return False
    # The rows' cp.async copies are 16 bytes wide: every row must start 16-byte aligned.
    if kv.stride(1) != 1 or kv.data_ptr() % 16 or (kv.stride(0) * kv.element_size()) % 16:
        return False
    if kv.dtype == torch.uint8:
        return kv.shape[1] == FP8_ROW_BYTES
    return kv.dtype == torch.bfloat16 and kv.shape[1] == D_QK


if GLUON_AVAILABLE:

    # Row layouts of the gathers' cp.async copies (16 bytes a thread), shared by `_load_ids` (which loads each
    # tile's index entries in them) and `_gather_tile` (which issues the copies).
    @gluon.constexpr_function
    def _latent_layout(fp8, num_warps):
        """The 512 e4m3 bytes of an FP8 row, or one 128-wide bf16 latent chunk."""
        if fp8:
            return gl.BlockedLayout([1, 16], [1, 32], [num_warps, 1], [1, 0])
        return gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _scale_layout(num_warps):
        """The four fp32 scales of an FP8 row."""
        return gl.BlockedLayout([1, 1], [8, 4], [num_warps, 1], [1, 0])

    @gluon.constexpr_function
    def _rope_layout(num_warps):
        """The 64 bf16 RoPE values of a row."""
        return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

    @gluon.jit
    def _tile_ids(idx_ptr, b, tile, end_tile, top_k, stride_ib, layout: gl.constexpr, BLOCK_N: gl.constexpr):
        """Index entries of one tile in `layout`; −1 for skipped entries and tiles past the split."""
        offs = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout)
        return gl.load(idx_ptr + b.to(gl.int64) * stride_ib + offs, mask=(offs < top_k) & (tile < end_tile), other=-1)

    @gluon.jit
    def _load_ids(idx_ptr, b, tile, end_tile, top_k, stride_ib, FP8: gl.constexpr, BLOCK_N: gl.constexpr,
                  num_warps: gl.constexpr):
        """One tile's index entries in the three layouts `_gather_tile` issues its copies in (the row layout of
        the latent part, of the FP8 scales and of the RoPE part). The kernel loads them a tile ahead of the
        gathers: loaded where the gathers are issued, their global-memory latency stalled every tile."""
        main: gl.constexpr = _latent_layout(FP8, num_warps)
        sc: gl.constexpr = _scale_layout(num_warps)
        narrow: gl.constexpr = _rope_layout(num_warps)
        ids_main = _tile_ids(idx_ptr, b, tile, end_tile, top_k, stride_ib, gl.SliceLayout(1, main), BLOCK_N)
        if FP8:
            ids_sc = _tile_ids(idx_ptr, b, tile, end_tile, top_k, stride_ib, gl.SliceLayout(1, sc), BLOCK_N)
        ids_r = _tile_ids(idx_ptr, b, tile, end_tile, top_k, stride_ib, gl.SliceLayout(1, narrow), BLOCK_N)
        if not FP8:
            ids_sc = ids_r  # bf16 rows have no scales to gather
        return ids_main, ids_sc, ids_r

    @gluon.jit
    def _gather_tile(kn_ring, kr_ring, raw_ring, scale_ring, kv_ptr, kv_f32_ptr, kv_bf16_ptr, ids_main, ids_sc,
                     ids_r, stage, stride_kv, stride_f32, stride_bf16, FP8: gl.constexpr, num_warps: gl.constexpr):
        """cp.async gathers of one tile's rows (its index entries from `_load_ids`; −1 entries zero-fill) into ring
        slot `stage`, as one commit group. bf16 rows: four 128-wide latent chunks and the RoPE part, straight into
        the wgmma tiles. FP8 rows (kv_ptr bytes, with its fp32 and bf16 views): the 512 e4m3 bytes, the four fp32
        scales and the bf16 RoPE part."""
        narrow: gl.constexpr = _rope_layout(num_warps)
        valid_r = ids_r >= 0
        rows_r = gl.where(valid_r, ids_r, 0).to(gl.int64)
        cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, narrow))
        valid = ids_main >= 0
        rows = gl.where(valid, ids_main, 0).to(gl.int64)
        if FP8:
            raw: gl.constexpr = _latent_layout(True, num_warps)
            cols = gl.arange(0, 512, layout=gl.SliceLayout(0, raw))
            async_copy.async_copy_global_to_shared(raw_ring.index(stage), kv_ptr + rows[:, None] * stride_kv
                                                   + cols[None, :], mask=valid[:, None])
            sc: gl.constexpr = _scale_layout(num_warps)
            valid_s = ids_sc >= 0
            rows_s = gl.where(valid_s, ids_sc, 0).to(gl.int64)
            chunk = gl.arange(0, 4, layout=gl.SliceLayout(0, sc))
            async_copy.async_copy_global_to_shared(
                scale_ring.index(stage), kv_f32_ptr + rows_s[:, None] * stride_f32 + 128 + chunk[None, :],
                mask=valid_s[:, None])
            # The RoPE part starts at byte 528 of a 656-byte row: 16-byte aligned, which the bf16 view's stride
            # (328 elements) does not tell the compiler.
            rope_offs = gl.multiple_of(rows_r * stride_bf16 + 264, 8)
            rope_ptr = kv_bf16_ptr + rope_offs[:, None] + cols_r[None, :]
        else:
            wide: gl.constexpr = _latent_layout(False, num_warps)
            cols = gl.arange(0, 128, layout=gl.SliceLayout(0, wide))
            base = kv_ptr + rows[:, None] * stride_kv + cols[None, :]
            for j in gl.static_range(4):
                async_copy.async_copy_global_to_shared(kn_ring.index(stage * 4 + j), base + j * 128,
                                                       mask=valid[:, None])
            rope_ptr = kv_ptr + rows_r[:, None] * stride_kv + 512 + cols_r[None, :]
        async_copy.async_copy_global_to_shared(kr_ring.index(stage), rope_ptr, mask=valid_r[:, None])
        async_copy.commit_group()

    @gluon.jit
    def _dequantize_chunk(kn_ring, raw_ring, scale_ring, stage, j: gl.constexpr, num_warps: gl.constexpr):
        """Chunk j (128 latent dims) of FP8 slot `stage` → the bf16 latent tile: e4m3 · power-of-two scale is exact
        in bf16. (Converting e4m3 straight to bf16 and scaling there gives the same bits but took 16 % longer at
        batch 64 on an H200: sm_90 converts e4m3 through f16 and f32 either way.)"""
        wide: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        # Every thread of a row holds the row's four scales (the rows map to threads as in `wide`), so picking a
        # chunk's scale needs no data movement.
        row_scales: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [num_warps, 1], [1, 0])
        scales = scale_ring.index(stage).load(row_scales)
        chunk = gl.arange(0, 4, layout=gl.SliceLayout(0, row_scales))
        scale = gl.sum(gl.where(chunk[None, :] == j, scales, 0.0), axis=1)
        scale = gl.convert_layout(scale, gl.SliceLayout(1, wide))
        raw = raw_ring.index(stage).slice(j * 128, 128, dim=1).load(wide)
        vals = raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]
        kn_ring.index(j).store(vals.to(gl.bfloat16))

    @gluon.jit
    def _sparse_mla_gluon_kernel(
        q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, idx_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
        stride_qb, stride_qh, stride_kv, stride_f32, stride_bf16, stride_ib, num_heads, top_k, scale_log2,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, TOKENS_PER_SPLIT: gl.constexpr, NUM_SPLITS: gl.constexpr,
        FP8: gl.constexpr, PAD_HEADS: gl.constexpr, num_warps: gl.constexpr,
    ):
        TILES: gl.constexpr = TOKENS_PER_SPLIT // BLOCK_N
        pid = gl.program_id(0)
        split = gl.program_id(1)
        if PAD_HEADS:  # 16 or 32 heads: one 64-head program a request; the rows past the heads are zeros
            b = pid
            h0 = 0
        else:
            head_blocks = num_heads // BLOCK_H
            b = pid // head_blocks
            h0 = (pid % head_blocks) * BLOCK_H

        # The scores [BLOCK_H, BLOCK_N] and each accumulator [BLOCK_H, 128] split over the two warp groups by
        # columns; shared tiles in the wgmma's swizzled layout.
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, BLOCK_N // (num_warps // 4), 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                           instr_shape=[16, 128 // (num_warps // 4), 16])
        tile_smem: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        p_smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
        plain: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        q_wide: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
        q_narrow: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

        q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], tile_smem)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], tile_smem)
        kr_ring = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, 64], tile_smem)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], p_smem_layout)
        if FP8:  # one bf16 latent tile, two slots of gathered FP8 bytes and scales
            kn_ring = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, 128], tile_smem)
            raw_ring = gl.allocate_shared_memory(gl.uint8, [2, BLOCK_N, 512], plain)
            scale_ring = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, 4], plain)
        else:  # two slots of bf16 latent tiles
            kn_ring = gl.allocate_shared_memory(gl.bfloat16, [8, BLOCK_N, 128], tile_smem)
            raw_ring = kn_ring
            scale_ring = kn_ring

        start_tile = split * TILES
        end_tile = start_tile + TILES
        ids_main, ids_sc, ids_r = _load_ids(idx_ptr, b, start_tile, end_tile, top_k, stride_ib, FP8, BLOCK_N,
                                            num_warps)
        _gather_tile(kn_ring, kr_ring, raw_ring, scale_ring, kv_ptr, kv_f32_ptr, kv_bf16_ptr, ids_main, ids_sc,
                     ids_r, start_tile % 2, stride_kv, stride_f32, stride_bf16, FP8, num_warps)
        # The next tile's index entries, loaded one tile ahead of its gathers.
        ids_main, ids_sc, ids_r = _load_ids(idx_ptr, b, start_tile + 1, end_tile, top_k, stride_ib, FP8, BLOCK_N,
                                            num_warps)
        # q lands in shared memory while the first tile's gathers are in flight.
        heads = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_wide))
        cols = gl.arange(0, 128, layout=gl.SliceLayout(0, q_wide))
        q_rows = q_ptr + b.to(gl.int64) * stride_qb + heads[:, None] * stride_qh
        # Padded (16 / 32 heads): the rows past the heads load as zeros (scores 0; their outputs are not stored).
        q_mask = (heads < num_heads)[:, None] if PAD_HEADS else None
        q_other = 0.0 if PAD_HEADS else None
        for j in gl.static_range(4):
            q_smem.index(j).store(gl.load(q_rows + j * 128 + cols[None, :], mask=q_mask, other=q_other))
        heads_r = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, q_narrow))
        cols_r = gl.arange(0, 64, layout=gl.SliceLayout(0, q_narrow))
        qr_mask = (heads_r < num_heads)[:, None] if PAD_HEADS else None
        qr_smem.store(gl.load(q_ptr + b.to(gl.int64) * stride_qb + heads_r[:, None] * stride_qh + 512
                              + cols_r[None, :], mask=qr_mask, other=q_other))

        acc0 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
        acc1 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
        acc2 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
        acc3 = gl.zeros([BLOCK_H, 128], gl.float32, layout=o_layout)
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_layout))
        offs_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        # The softmax's mask entries, also loaded a tile ahead.
        ids_s = gl.load(idx_ptr + b.to(gl.int64) * stride_ib + start_tile * BLOCK_N + offs_s)
        for t in range(0, TILES):
            tile = start_tile + t
            stage = tile % 2
            # Gathers of the next tile into the slot the previous tile freed (its PV was waited for, then a
            # barrier); they land while this tile is processed. Then the index entries of the tile after it, and
            # wait for this tile's own group.
            _gather_tile(kn_ring, kr_ring, raw_ring, scale_ring, kv_ptr, kv_f32_ptr, kv_bf16_ptr, ids_main, ids_sc,
                         ids_r, (tile + 1) % 2, stride_kv, stride_f32, stride_bf16, FP8, num_warps)
            ids_main, ids_sc, ids_r = _load_ids(idx_ptr, b, tile + 2, end_tile, top_k, stride_ib, FP8, BLOCK_N,
                                                num_warps)
            async_copy.wait_group(1)
            gl.thread_barrier()
            if FP8:
                for j in gl.static_range(4):
                    _dequantize_chunk(kn_ring, raw_ring, scale_ring, stage, j, num_warps)
                kn_base = 0
            else:
                kn_base = stage * 4
            fence_async_shared()
            gl.thread_barrier()

            s = warpgroup_mma(q_smem.index(0), kn_ring.index(kn_base).permute((1, 0)),
                              gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout), use_acc=False, is_async=True)
            for j in gl.static_range(1, 4):
                s = warpgroup_mma(q_smem.index(j), kn_ring.index(kn_base + j).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma(qr_smem, kr_ring.index(stage).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

            idx = ids_s
            ids_s = gl.load(idx_ptr + b.to(gl.int64) * stride_ib + (tile + 1) * BLOCK_N + offs_s,
                            mask=tile + 1 < end_tile, other=-1)
            scores = gl.where((idx >= 0)[None, :], s * scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(scores, axis=1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(scores - m_safe[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            p_smem.store(p.to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            acc0 = warpgroup_mma(p_smem, kn_ring.index(kn_base + 0), acc0 * alpha_o, is_async=True)
            acc1 = warpgroup_mma(p_smem, kn_ring.index(kn_base + 1), acc1 * alpha_o, is_async=True)
            acc2 = warpgroup_mma(p_smem, kn_ring.index(kn_base + 2), acc2 * alpha_o, is_async=True)
            acc3 = warpgroup_mma(p_smem, kn_ring.index(kn_base + 3), acc3 * alpha_o, is_async=True)
            acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
            gl.thread_barrier()
        async_copy.wait_group(0)

        has = l_i > 0.0
        inv = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
        lse2 = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        inv_o = gl.convert_layout(inv, gl.SliceLayout(1, o_layout))[:, None]
        heads_o = h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
        bh_o = b.to(gl.int64) * num_heads + heads_o
        bh_s = b.to(gl.int64) * num_heads + h0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout))
        ok_o = (heads_o < num_heads)[:, None] if PAD_HEADS else None  # padded: the rows past the heads not stored
        ok_s = gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, s_layout)) < num_heads if PAD_HEADS else None
        if NUM_SPLITS == 1:
            o_rows = out_ptr + bh_o[:, None] * 512 + cols_o[None, :]
            gl.store(o_rows, (acc0 * inv_o).to(gl.bfloat16), mask=ok_o)
            gl.store(o_rows + 128, (acc1 * inv_o).to(gl.bfloat16), mask=ok_o)
            gl.store(o_rows + 256, (acc2 * inv_o).to(gl.bfloat16), mask=ok_o)
            gl.store(o_rows + 384, (acc3 * inv_o).to(gl.bfloat16), mask=ok_o)
            gl.store(lse_ptr + bh_s, gl.where(has, lse2 * 0.6931471805599453, float("inf")), mask=ok_s)
        else:
            p_rows = part_out_ptr + (bh_o * NUM_SPLITS + split)[:, None] * 512 + cols_o[None, :]
            gl.store(p_rows, acc0 * inv_o, mask=ok_o)
            gl.store(p_rows + 128, acc1 * inv_o, mask=ok_o)
            gl.store(p_rows + 256, acc2 * inv_o, mask=ok_o)
            gl.store(p_rows + 384, acc3 * inv_o, mask=ok_o)
            gl.store(part_lse_ptr + bh_s * NUM_SPLITS + split, lse2, mask=ok_s)


def sparse_mla_decode_gluon(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, scale: float,
                            splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; only for launches `gluon_can_run` accepts. `splits` forces the split count of the
    top-k list (benchmarks); by default it follows the shapes (`sparse_mla_plan.choose_splits`, Gluon's costs)."""
    from kernels.sparse_mla_triton import _combine_kernel, _num_sms

    if not gluon_can_run(q, kv, indices):
        raise ValueError(f"the Gluon kernel does not take q {tuple(q.shape)} {q.dtype}, kv {tuple(kv.shape)} "
                         f"{kv.dtype}, indices {tuple(indices.shape)} on this device")
    batch, num_heads, _ = q.shape
    top_k = indices.shape[1]
    fp8 = kv.dtype == torch.uint8
    if q.stride(2) != 1 or q.stride(1) % 8:
        q = q.contiguous()
    indices = indices.to(torch.int32)
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    tiles = top_k // BLOCK_N
    pad_heads = num_heads < BLOCK_H
    if splits is None:  # the split model prices the programs as they run: 16 / 32 heads padded to 64
        splits = choose_splits(batch, max(num_heads, BLOCK_H), top_k, BLOCK_H, BLOCK_N,
                               _num_sms(q.device.index or 0), fp8, kernel="gluon")
    if tiles % splits:
        raise ValueError(f"splits={splits} must divide the {tiles} tiles of the top-k list")
    out = torch.empty((batch, num_heads, D_V), dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=q.device)
    if batch == 0:
        return out, lse
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, D_V), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_out, part_lse = out, lse  # unused
    if fp8:
        kv_f32, kv_bf16 = kv.view(torch.float32), kv.view(torch.bfloat16)
    else:
        kv_f32 = kv_bf16 = kv
    _sparse_mla_gluon_kernel[(batch * max(num_heads // BLOCK_H, 1), splits)](
        q, kv, kv_f32, kv_bf16, indices, out, lse, part_out, part_lse, q.stride(0), q.stride(1), kv.stride(0),
        kv_f32.stride(0), kv_bf16.stride(0), indices.stride(0),
        num_heads, top_k, float(scale) * LOG2E, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, TOKENS_PER_SPLIT=top_k // splits,
        NUM_SPLITS=splits, FP8=fp8, PAD_HEADS=pad_heads, num_warps=NUM_WARPS)
    if splits > 1:
        _combine_kernel[(batch * num_heads,)](part_out, part_lse, out, lse, NUM_SPLITS=splits,
                                              SPLITS_P2=triton.next_power_of_2(splits), num_warps=4)
    return out, lse
