"""Block-FP8 GEMMs in Triton (DeepSeek's recipe, semantics in kernels/fp8_gemm_ref.py): activation quantization,
a dense GEMM and a grouped GEMM over the experts of a MoE batch, with an optional deterministic split-K.

Quantization (`quantize_activations`): one program per (row, 8 groups of 128 channels): amax per group, scale =
max(amax, eps) / 448 and q = RNE(x / scale) with IEEE division (`div_rn`; Triton's `/` is approximate) and the
rounding to the e4m3 grid done explicitly in float32 (`_round_e4m3`), so the result is the reference's bit for
bit on the GPU and in Triton's CPU interpreter (whose own float32 → e4m3 conversion mis-rounds values that carry
into the next binade: -31.65 became -16, found with Triton 3.6). The scales are stored group-major, [G, M_pad]:
the layout `torch._scaled_mm` wants for 1×128 scales (M contiguous), read through strides by the kernels below.
Rows M..M_pad-1 (padding some backends need) are written as zeros.

Dense GEMM (`fp8_gemm`): program (n tile, m tile, k split) walks its K tiles of 128 (one activation group and one
weight block column each): acc += dot(q_x, q_wᵀ) · s_x[m] · s_w[n // 128] in float32, so the scales are applied
every 128 channels (DeepSeek's "promotion" interval; Hopper's FP8 MMA accumulates with reduced precision inside
one instruction chain). With split-K each split writes float32 partials and `_splitk_sum_kernel` adds them in split
order: no atomics, so a result depends only on the inputs and the launch configuration (batch-invariant mode and
HiSparse == dense rely on that).

Grouped GEMM (`fp8_grouped_gemm`): the rows are sorted by expert, expert e owning rows [end[e-1], end[e]) (the
offsets come from the device: no host sync). Program (n tile, e · m_progs + j, k split) computes expert e's row
tiles j, j + m_progs, …; an expert without rows costs one offsets load and reads no weights, so a decode step reads
only the experts it routed to. Rows past end[E-1] (other ranks' choices with expert parallelism) are not written.

Launch shapes never depend on device values, and nothing syncs with the host: every call is CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
GROUP = 128
ACT_EPS = 1e-10
# The same constants as seen from inside kernels (Triton kernels may read only constexpr globals).
_FP8_MAX_C = tl.constexpr(FP8_MAX)
_ACT_EPS_C = tl.constexpr(ACT_EPS)
_GROUPS_PER_PROGRAM = 8
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class TritonGemmConfig:
    """Launch configuration of the dense and grouped kernels (the autotuner picks one per shape)."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    m_programs: int = 1  # grouped kernel: programs per expert along M (each takes every m_programs-th row tile)

    def label(self) -> str:
        grouped = f" mp{self.m_programs}" if self.m_programs != 1 else ""
        return (f"triton bm{self.block_m} bn{self.block_n} sk{self.split_k} w{self.num_warps} "
                f"s{self.num_stages}{grouped}")


@triton.jit
def _round_e4m3(v):
    """Round float32 v (|v| ≤ 448 after the caller's scaling) to the nearest e4m3 value, ties to even, in float32.

    The grid step near |v| is 2^(e-3) for v in [2^e, 2^(e+1)) (3 mantissa bits), 2^-9 below 2^-6 (subnormals).
    Adding C = 2^(step exponent + 23) puts |v| + C where float32's spacing is exactly that step, so the addition
    rounds |v| to the grid (ties to even) and subtracting C is exact."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent - 3, -9)
    c = ((step_exp + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = tl.minimum((a + c) - c, _FP8_MAX_C)
    return tl.where(v < 0, -r, r)


@triton.jit(do_not_specialize=["m", "m_pad"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, m, m_pad, k, stride_xm, stride_qm, stride_sg,
                     GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    in_k = cols < k
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=in_k & (row < m), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _ACT_EPS_C), tl.full([GROUPS], _FP8_MAX_C, tl.float32))
    values = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], [GROUPS, GROUP_SIZE]))
    q = _round_e4m3(values).to(tl.float8e4nv)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + cols, q, mask=in_k)
    num_groups = tl.cdiv(k, GROUP_SIZE)
    tl.store(s_ptr + groups * stride_sg + row, scale, mask=groups < num_groups)


def quantize_activations(x: torch.Tensor, pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp16/fp32, last dim contiguous) → (q [M_pad, K] float8_e4m3fn, scales [G, M_pad] float32),
    M_pad = M rounded up to `pad_rows_to`; padded rows are zeros."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    m_pad = -(-m // pad_rows_to) * pad_rows_to if m else 0
    groups = triton.cdiv(k, GROUP)
    q = torch.empty(m_pad, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(groups, m_pad, dtype=torch.float32, device=x.device)
    if m_pad and k:
        grid = (m_pad, triton.cdiv(groups, _GROUPS_PER_PROGRAM))
        _quantize_kernel[grid](x, q, scales, m, m_pad, k, x.stride(0), q.stride(0), scales.stride(0),
                               GROUPS=_GROUPS_PER_PROGRAM, GROUP_SIZE=GROUP)
    return q, scales


@triton.jit
def _tile_product(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, row_ok, offs_n, n_ok, t_start, num_tiles, k,
                  stride_am, stride_asg, stride_bn, stride_bsn, stride_bsk,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr):
    """Σ over K tiles t_start .. t_start + num_tiles − 1 (those inside K) of dot(q_x, q_wᵀ) · s_x · s_w for rows
    offs_m and columns offs_n, in float32. The trip count is a kernel argument (a plain loop Triton pipelines;
    the last split's tiles past K are masked, scales included, so garbage never meets a zero)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(k, BLOCK_K)
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn
    b_scale_rows = bs_ptr + (offs_n // SCALE_BN) * stride_bsn
    for i in range(0, num_tiles):
        t = t_start + i
        tile_ok = t < k_tiles
        cols = t * BLOCK_K + offs_k
        k_ok = cols < k
        a = tl.load(a_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptr + t * stride_asg + offs_m, mask=row_ok & tile_ok, other=0.0)
        b_s = tl.load(b_scale_rows + t * stride_bsk, mask=n_ok & tile_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit(do_not_specialize=["m", "tiles_per_split"])
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, m, n, k, tiles_per_split,
                     stride_am, stride_asg, stride_bn, stride_bsn, stride_bsk, stride_cm, stride_csplit,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < m
    n_ok = offs_n < n
    acc = _tile_product(a_ptr, as_ptr, b_ptr, bs_ptr, offs_m, row_ok, offs_n, n_ok, pid_k * tiles_per_split,
                        tiles_per_split, k,
                        stride_am, stride_asg, stride_bn, stride_bsn, stride_bsk,
                        BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN)
    out = c_ptr + pid_k.to(tl.int64) * stride_csplit + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["tiles_per_split", "m_progs"])
def _fp8_grouped_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ends_ptr, n, k, tiles_per_split, m_progs,
                             stride_am, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                             stride_cm, stride_csplit,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SCALE_BN: tl.constexpr):
    pid_n = tl.program_id(0)
    expert = tl.program_id(1) // m_progs
    part = tl.program_id(1) % m_progs
    pid_k = tl.program_id(2)
    end = tl.load(ends_ptr + expert)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    t_start = pid_k * tiles_per_split
    b_expert = b_ptr + expert.to(tl.int64) * stride_be
    bs_expert = bs_ptr + expert.to(tl.int64) * stride_bse
    # A while loop: its bounds come from device memory (a for-range over them also works compiled, not in
    # Triton's interpreter, which the CPU tests use).
    m0 = start + part * BLOCK_M
    while m0 < end:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < end
        acc = _tile_product(a_ptr, as_ptr, b_expert, bs_expert, offs_m, row_ok, offs_n, n_ok, t_start,
                            tiles_per_split, k, stride_am, stride_asg, stride_bn, stride_bsn, stride_bsk,
                            BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN)
        out = (c_ptr + pid_k.to(tl.int64) * stride_csplit + offs_m.to(tl.int64)[:, None] * stride_cm
               + offs_n[None, :])
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
        m0 += m_progs * BLOCK_M


@triton.jit(do_not_specialize=["numel", "splits"])
def _splitk_sum_kernel(p_ptr, out_ptr, numel, splits, BLOCK: tl.constexpr):
    """out[i] = Σ_s partials[s, i] in split order (deterministic), cast to out's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(p_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _splits(k: int, split_k: int) -> tuple[int, int]:
    """(splits, K tiles per split) with no empty split."""
    k_tiles = max(1, triton.cdiv(k, GROUP))
    per_split = triton.cdiv(k_tiles, max(1, min(split_k, k_tiles)))
    return triton.cdiv(k_tiles, per_split), per_split


def _output(rows: int, n: int, splits: int, out_dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if splits == 1:
        return torch.empty(rows, n, dtype=out_dtype, device=device)
    return torch.empty(splits, rows, n, dtype=torch.float32, device=device)


def _reduce(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if partials.dim() == 2:
        return partials
    splits, rows, n = partials.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=partials.device)
    numel = rows * n
    if numel:
        _splitk_sum_kernel[(triton.cdiv(numel, _REDUCE_BLOCK),)](partials, out, numel, splits, BLOCK=_REDUCE_BLOCK)
    return out


def _check_weight(w: torch.Tensor, w_scale: torch.Tensor, k: int, block: tuple[int, int]) -> None:
    if w.dtype != torch.float8_e4m3fn or w.shape[-1] != k or w.stride(-1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [..., N, {k}] with contiguous rows, got {w.dtype} "
                         f"{tuple(w.shape)} stride {w.stride()}")
    if block[1] != GROUP:
        raise ValueError(f"the kernels take 128-channel K blocks (one activation group each), got {block}")
    expected = (triton.cdiv(w.shape[-2], block[0]), triton.cdiv(k, block[1]))
    if tuple(w_scale.shape[-2:]) != expected or w_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale_inv must be float32 [..., {expected[0]}, {expected[1]}], got "
                         f"{w_scale.dtype} {tuple(w_scale.shape)}")


def fp8_gemm(q: torch.Tensor, scales: torch.Tensor, m: int, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: TritonGemmConfig, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """(q [≥m, K] e4m3, scales [G, ≥m] group-major) @ dequant(w [N, K])ᵀ → [m, N] out_dtype."""
    k = q.shape[1]
    _check_weight(w, w_scale, k, block)
    n = w.shape[0]
    splits, per_split = _splits(k, config.split_k)
    out = _output(m, n, splits, out_dtype, q.device)
    if m and n:
        grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
        _fp8_gemm_kernel[grid](
            q, scales, w, w_scale, out, m, n, k, per_split,
            q.stride(0), scales.stride(0), w.stride(0), w_scale.stride(0), w_scale.stride(1),
            out.stride(-2), out.stride(0) if splits > 1 else 0,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=GROUP, SCALE_BN=block[0],
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return _reduce(out, out_dtype)


def fp8_grouped_gemm(q: torch.Tensor, scales: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     end_offsets: torch.Tensor, out_dtype: torch.dtype, config: TritonGemmConfig,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Rows of q [M, K] (scales [G, M] group-major) sorted by expert; expert e (weight w[e] [N, K], scales
    w_scale[e]) owns rows [end_offsets[e-1], end_offsets[e]) (int32 [E], on the device) → [M, N] out_dtype;
    rows past end_offsets[E-1] are left undefined."""
    m, k = q.shape
    _check_weight(w, w_scale, k, block)
    if w.dim() != 3 or w_scale.dim() != 3 or end_offsets.numel() != w.shape[0]:
        raise ValueError(f"grouped weights must be [E, N, K] with E end offsets; got {tuple(w.shape)}, "
                         f"{tuple(w_scale.shape)}, {end_offsets.numel()} offsets")
    experts, n = w.shape[0], w.shape[1]
    splits, per_split = _splits(k, config.split_k)
    out = _output(m, n, splits, out_dtype, q.device)
    if m and n and experts:
        grid = (triton.cdiv(n, config.block_n), experts * config.m_programs, splits)
        _fp8_grouped_gemm_kernel[grid](
            q, scales, w, w_scale, out, end_offsets, n, k, per_split, config.m_programs,
            q.stride(0), scales.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
            w_scale.stride(2), out.stride(-2), out.stride(0) if splits > 1 else 0,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=GROUP,
            SCALE_BN=block[0], num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return _reduce(out, out_dtype)
