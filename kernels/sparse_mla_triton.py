"""Sparse MLA decode in Triton (same semantics as kernels/sparse_mla_ref.py).

q [B, H, 576] bf16, KV rows [N, 576] bf16 or [N, 656] uint8 FP8 rows (kernels/fp8_rows.py), indices [B, K]
int32 (−1 = skip) → out [B, H, 512] bf16, lse [B, H] fp32 (natural log; all-skipped: 0 and +inf).

Design (docs/kernels.md): one program per (request, block of heads, split of the top-k list). Each program
streams BLOCK_N selected rows at a time, gathers them by slot id, and runs an online softmax in base 2 with
the 512 latent dims handled as four 128-wide tiles. An FP8 tile is dequantized with its power-of-two scale
into q's dtype as it is loaded (exact), so FP8 and float rows share one loop: one chained QK accumulator and
one P for the four PV dots. (Applying the scale to the score tile and to P instead took four separate QK dots
and four scaled P tiles and spilled registers: 1.5× slower, docs/benchmarks.md.) When the batch is too small to fill
the GPU, the top-k list is split and a combine kernel merges the partial results by their LSE.
The split count depends only on (B, H, K) and each program reads rows in top-k order, so the result depends
only on the selected rows and their order, not on which slots hold them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.sparse_mla_plan import choose_splits

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
D_QK = 576
D_V = 512
FP8_ROW_BYTES = 656


@triton.jit
def _load_kv_tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, TILE: tl.constexpr, FP8: tl.constexpr,
                  OUT: tl.constexpr):
    """One 128-wide latent tile of the gathered rows in q's dtype OUT [BLOCK_N, 128]. FP8 tiles come back already
    multiplied by their per-row scale: kernels/fp8_rows.py's scales are powers of two, so e4m3 · scale is exact in
    bf16, and the loop after it is the float rows' one (one chained QK accumulator, one P for the four PV dots)."""
    offs = tl.arange(0, 128)
    if FP8:
        raw = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None], other=0)
        scale = tl.load(kv_f32_ptr + rows * stride_f32 + 128 + TILE, mask=valid, other=0.0)
        vals = (raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale[:, None]).to(OUT)
    else:
        vals = tl.load(kv_ptr + rows[:, None] * stride_kv + TILE * 128 + offs[None, :], mask=valid[:, None],
                       other=0.0)
    return vals


@triton.jit
def _sparse_mla_decode_kernel(
    q_ptr, kv_ptr, kv_f32_ptr, kv_bf16_ptr, idx_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_f32, stride_bf16, stride_ib,
    num_heads, top_k, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
    FP8: tl.constexpr, ROPE_ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
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

    start = split * TOKENS_PER_SPLIT
    for tile in range(0, TOKENS_PER_SPLIT // BLOCK_N):
        offs_n = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + offs_n)  # in range: splits · TOKENS_PER_SPLIT == K
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        k0 = _load_kv_tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 0, FP8, q0.dtype)
        k1 = _load_kv_tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 1, FP8, q0.dtype)
        k2 = _load_kv_tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 2, FP8, q0.dtype)
        k3 = _load_kv_tile(kv_ptr, kv_f32_ptr, rows, valid, stride_kv, stride_f32, 3, FP8, q0.dtype)
        if FP8:
            rope_offs = rows * stride_bf16 + 264
            if ROPE_ALIGNED:
                # Byte 528 of a 16-byte aligned row: the hint lets these loads (and the tile's index entries with
                # them) be pipelined 16-byte cp.async copies instead of a synchronous load every iteration.
                rope_offs = tl.multiple_of(rope_offs, 8)
            kr = tl.load(kv_bf16_ptr + rope_offs[:, None] + offs_r[None, :], mask=valid[:, None],
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
    if NUM_SPLITS == 1:
        o_rows = out_ptr + bh[:, None] * 512
        tl.store(o_rows + offs[None, :], (acc0 * inv[:, None]).to(out_ptr.dtype.element_ty))
        tl.store(o_rows + 128 + offs[None, :], (acc1 * inv[:, None]).to(out_ptr.dtype.element_ty))
        tl.store(o_rows + 256 + offs[None, :], (acc2 * inv[:, None]).to(out_ptr.dtype.element_ty))
        tl.store(o_rows + 384 + offs[None, :], (acc3 * inv[:, None]).to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + bh, tl.where(has, lse2 * 0.6931471805599453, float("inf")))
    else:
        part = bh * NUM_SPLITS + split
        p_rows = part_out_ptr + part[:, None] * 512
        tl.store(p_rows + offs[None, :], acc0 * inv[:, None])
        tl.store(p_rows + 128 + offs[None, :], acc1 * inv[:, None])
        tl.store(p_rows + 256 + offs[None, :], acc2 * inv[:, None])
        tl.store(p_rows + 384 + offs[None, :], acc3 * inv[:, None])
        tl.store(part_lse_ptr + part, lse2)


@triton.jit
def _sparse_mla_decode_wide_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, lse_ptr, part_out_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_kv, stride_ib,
    num_heads, top_k, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, TOKENS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    """Float rows only: the 512 latent dims as one tile (one QK dot of depth 512, one PV dot of width 512)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    head_blocks = num_heads // BLOCK_H
    b = pid // head_blocks
    heads = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    qn = tl.load(q_rows + offs_d[None, :])
    qr = tl.load(q_rows + 512 + offs_r[None, :])
    acc = tl.zeros([BLOCK_H, 512], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    start = split * TOKENS_PER_SPLIT
    for tile in range(0, TOKENS_PER_SPLIT // BLOCK_N):
        offs_n = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + b.to(tl.int64) * stride_ib + offs_n)
        valid = idx >= 0
        rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kv
        kn = tl.load(rows + offs_d[None, :], mask=valid[:, None], other=0.0)
        kr = tl.load(rows + 512 + offs_r[None, :], mask=valid[:, None], other=0.0)
        scores = tl.dot(qn, tl.trans(kn))
        scores = tl.dot(qr, tl.trans(kr), scores)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(kn.dtype), kn, acc * alpha[:, None])
        m_i = m_new
    has = l_i > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse2 = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    bh = b.to(tl.int64) * num_heads + heads
    if NUM_SPLITS == 1:
        tl.store(out_ptr + bh[:, None] * 512 + offs_d[None, :], (acc * inv[:, None]).to(out_ptr.dtype.element_ty))
        tl.store(lse_ptr + bh, tl.where(has, lse2 * 0.6931471805599453, float("inf")))
    else:
        part = bh * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * 512 + offs_d[None, :], acc * inv[:, None])
        tl.store(part_lse_ptr + part, lse2)


@triton.jit
def _combine_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, NUM_SPLITS: tl.constexpr,
                    SPLITS_P2: tl.constexpr):
    """Merge the splits of one (request, head) by their base-2 LSE, in split order."""
    bh = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_P2)
    in_range = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + bh * NUM_SPLITS + offs_s, mask=in_range, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    denom = tl.sum(w, axis=0)
    has = denom > 0.0
    w = w / tl.where(has, denom, 1.0)
    offs_d = tl.arange(0, 512)
    parts = tl.load(part_out_ptr + (bh * NUM_SPLITS + offs_s)[:, None] * 512 + offs_d[None, :],
                    mask=in_range[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(out_ptr + bh * 512 + offs_d, out.to(out_ptr.dtype.element_ty))
    tl.store(lse_ptr + bh, tl.where(has, (m_safe + tl.log2(tl.where(has, denom, 1.0))) * 0.6931471805599453,
                                    float("inf")))


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_config(num_heads: int, fp8: bool) -> dict[str, int]:
    """Block sizes by head count (measured on an H200, docs/benchmarks-history.md): 64 heads per program at most.
    32 heads with FP8 rows take 8 warps: with 4 the dequantized tile keeps 672 B of stack a thread, and 8 warps run
    1.59-1.76x faster at B 16-256 (H200, 2026-11-28); 16 heads and bf16 32 heads stay faster with 4."""
    block_h = min(num_heads, 64)
    wide = block_h == 64 or (fp8 and block_h == 32)
    return {"BLOCK_H": block_h, "BLOCK_N": 64, "num_warps": 8 if wide else 4, "num_stages": 2}


def sparse_mla_decode_triton(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    scale: float,
    config: dict[str, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. `config` overrides the block sizes (benchmarks try alternatives); "WIDE": 1
    selects, for float rows, the variant that treats the 512 latent dims as one tile; "SPLITS": n forces the
    split count (the benchmark's split sweep; batch-invariant mode fixes it, otherwise it follows the batch size)."""
    if q.dim() != 3 or q.shape[2] != D_QK or indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"expected q [B, H, 576] and indices [B, K], got {tuple(q.shape)}, {tuple(indices.shape)}")
    batch, num_heads, _ = q.shape
    top_k = indices.shape[1]
    fp8 = kv.dtype == torch.uint8
    if fp8:
        if kv.dim() != 2 or kv.shape[1] != FP8_ROW_BYTES or kv.stride(1) != 1 or kv.stride(0) % 4 != 0:
            raise ValueError(f"FP8 rows must be [N, 656] uint8 with contiguous rows, got {tuple(kv.shape)}")
    elif kv.dim() != 2 or kv.shape[1] != D_QK or kv.dtype != q.dtype or kv.stride(1) != 1:
        raise ValueError(f"float rows must be [N, 576] of q's dtype {q.dtype}, got {tuple(kv.shape)} {kv.dtype}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"q must be bf16 or fp16, got {q.dtype}")
    cfg = dict(default_config(num_heads, fp8) if config is None else config)
    block_h, block_n = cfg["BLOCK_H"], cfg["BLOCK_N"]
    if num_heads % block_h or top_k % block_n or top_k == 0:
        raise ValueError(f"heads ({num_heads}) must be a multiple of {block_h} and K ({top_k}) of {block_n}")
    if q.stride(2) != 1:
        q = q.contiguous()
    indices = indices.to(torch.int32)
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    device = q.device
    num_sms = _num_sms(device.index or 0) if device.type == "cuda" else 132  # 132: Triton's CPU interpreter
    splits = cfg.get("SPLITS") or choose_splits(batch, num_heads, top_k, block_h, block_n, num_sms, fp8)
    if (top_k // block_n) % splits:
        raise ValueError(f"SPLITS={splits} must divide the {top_k // block_n} tiles of the top-k list")
    out = torch.empty((batch, num_heads, D_V), dtype=q.dtype, device=device)
    lse = torch.empty((batch, num_heads), dtype=torch.float32, device=device)
    if batch == 0:
        return out, lse
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, D_V), dtype=torch.float32, device=device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=device)
    else:
        part_out, part_lse = out, lse  # unused
    if fp8:
        kv_f32 = kv.view(torch.float32)
        kv_bf16 = kv.view(torch.bfloat16)
        strides = (kv.stride(0), kv_f32.stride(0), kv_bf16.stride(0))
    else:
        kv_f32 = kv_bf16 = kv
        strides = (kv.stride(0), kv.stride(0), kv.stride(0))
    grid = (batch * (num_heads // block_h), splits)
    if cfg.get("WIDE", 0) and not fp8:
        _sparse_mla_decode_wide_kernel[grid](
            q, kv, indices, out, lse, part_out, part_lse,
            q.stride(0), q.stride(1), kv.stride(0), indices.stride(0),
            num_heads, top_k, float(scale) * LOG2E,
            BLOCK_H=block_h, BLOCK_N=block_n, TOKENS_PER_SPLIT=top_k // splits, NUM_SPLITS=splits,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    else:
        _sparse_mla_decode_kernel[grid](
            q, kv, kv_f32, kv_bf16, indices, out, lse, part_out, part_lse,
            q.stride(0), q.stride(1), *strides, indices.stride(0),
            num_heads, top_k, float(scale) * LOG2E,
            BLOCK_H=block_h, BLOCK_N=block_n, TOKENS_PER_SPLIT=top_k // splits, NUM_SPLITS=splits, FP8=fp8,
            ROPE_ALIGNED=fp8 and kv.data_ptr() % 16 == 0 and kv.stride(0) % 16 == 0,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    if splits > 1:
        _combine_kernel[(batch * num_heads,)](
            part_out, part_lse, out, lse, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out, lse
