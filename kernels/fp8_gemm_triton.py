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
Two launch options change only when programs run, never what they compute: `experts_reversed` maps the grid's
expert index backwards, so the last expert's programs (a fused shared expert: a row of every token, the longest)
start first instead of ending the GEMM a wave late; `max_registers` caps a thread's registers (Triton's maxnreg)
so more programs share an SM.

Fused variants (`TritonGemmConfig.fuse_quant`, `fuse_reduce`), for decode's small M where each extra kernel costs
more than its work (a batch-1 projection was three kernels: quantize, GEMM, split-K sum):
  - fuse_quant: the GEMM reads the bf16 activations and quantizes each [rows, 128] tile itself with exactly the
    quantization kernel's arithmetic (`_quantize_values`), so the products, and the output, are the same bits as the
    unfused path with the same tiles; every column tile's programs quantize the same rows again (cheap while M is
    small: the tuner measures where it stops paying).
  - fuse_reduce (split-K): each split writes its float32 partial, then takes a ticket from a per-tile counter
    (`tl.atomic_add`, acquire-release at GPU scope, after a block barrier so the whole tile's stores are ordered
    before it); the split that arrives last sums the partials in split order — the sum kernel's order, so again
    the same bits whichever split arrives last — writes the output and resets the counter to 0 for the next call.
    The counters are one zeroed int32 buffer per device and stream (`_tile_counters`), reused by every call on
    that stream (calls on one stream never overlap).

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
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


@dataclass(frozen=True)
class TritonGemmConfig:
    """Launch configuration of the dense and grouped kernels (the autotuner picks one per shape)."""

    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    m_programs: int = 1  # grouped kernel: programs per expert along M (each takes every m_programs-th row tile)
    fuse_quant: bool = False  # quantize the activations inside the GEMM (no quantization kernel)
    fuse_reduce: bool = False  # split-K: the last split of a tile sums the partials (no sum kernel)
    gemv_groups: int = 0  # > 0: the one-row kernel (`fp8_gemv`), this many 128-channel groups a loop step
    gemv_stages: int = 1  # the one-row kernel's loop: > 1 keeps that many steps' weight tiles in flight (cp.async)
    gemv_row_programs: bool = False  # grouped one-row kernel: a program per (column block, row), not per expert
    max_registers: int = 0  # > 0: Triton's maxnreg, registers a thread (more programs an SM); 0: the compiler's
    experts_reversed: bool = False  # grouped kernel: programs of the last expert first (a fused shared expert)

    def label(self) -> str:
        if self.gemv_groups:
            return (f"triton gemv bn{self.block_n} g{self.gemv_groups} w{self.num_warps}"
                    f"{f' ls{self.gemv_stages}' if self.gemv_stages > 1 else ''}{' fq' if self.fuse_quant else ''}"
                    f"{' rp' if self.gemv_row_programs else ''}")
        grouped = (f" mp{self.m_programs}" if self.m_programs != 1 else "") + (" rev" if self.experts_reversed else "")
        fused = (" fq" if self.fuse_quant else "") + (" fr" if self.fuse_reduce and self.split_k > 1 else "")
        registers = f" r{self.max_registers}" if self.max_registers else ""
        return (f"triton bm{self.block_m} bn{self.block_n} sk{self.split_k} w{self.num_warps} "
                f"s{self.num_stages}{registers}{grouped}{fused}")


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


@triton.jit
def _quantize_values(x):
    """x [R, GROUP] float32 (one 128-channel group per row) → (e4m3 values, float32 scale per row)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, _ACT_EPS_C), tl.full(amax.shape, _FP8_MAX_C, tl.float32))
    q = _round_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))).to(tl.float8e4nv)
    return q, scale


@triton.jit(do_not_specialize=["m", "m_pad"])
def _quantize_kernel(x_ptr, q_ptr, s_ptr, m, m_pad, k, stride_xm, stride_qm, stride_sg,
                     GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr):
    row = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    in_k = cols < k
    x = tl.load(x_ptr + row.to(tl.int64) * stride_xm + cols, mask=in_k & (row < m), other=0.0).to(tl.float32)
    q, scale = _quantize_values(x)
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
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr,
                  FUSE_QUANT: tl.constexpr):
    """Σ over K tiles t_start .. t_start + num_tiles − 1 (those inside K) of dot(q_x, q_wᵀ) · s_x · s_w for rows
    offs_m and columns offs_n, in float32. The trip count is a kernel argument (a plain loop Triton pipelines;
    the last split's tiles past K are masked, scales included, so garbage never meets a zero). FUSE_QUANT: a_ptr
    is the unquantized activations (as_ptr unused), each tile quantized here as the quantization kernel would."""
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
        if FUSE_QUANT:
            x = tl.load(a_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            # Rows past M read as 1, not 0: a zero dividend sends IEEE division to its slow path (measured 2-3x
            # slower at M = 1, where 15 of the tile's 16 rows are padding); their scale is zeroed below anyway.
            x = tl.where(row_ok[:, None], x, 1.0)
            a, a_s = _quantize_values(x)
            a_s = tl.where(row_ok & tile_ok, a_s, 0.0)
        else:
            a = tl.load(a_rows + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a_s = tl.load(as_ptr + t * stride_asg + offs_m, mask=row_ok & tile_ok, other=0.0)
        b = tl.load(b_rows + cols[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        b_s = tl.load(b_scale_rows + t * stride_bsk, mask=n_ok & tile_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    return acc


@triton.jit
def _store_tile(acc, c_ptr, ws_ptr, counter_ptr, offs_m, row_ok, offs_n, n_ok, pid_k, splits,
                stride_cm, stride_ws_split, stride_ws_m, FUSE_REDUCE: tl.constexpr):
    """Write one output tile: straight to c (no split-K), as split pid_k's float32 partial (the sum kernel adds
    them), or — FUSE_REDUCE — as a partial after which the last of the tile's splits sums all of them in split
    order into c (module docstring)."""
    mask = row_ok[:, None] & n_ok[None, :]
    if FUSE_REDUCE:
        part = ws_ptr + offs_m.to(tl.int64)[:, None] * stride_ws_m + offs_n[None, :]
        tl.store(part + pid_k.to(tl.int64) * stride_ws_split, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial stores are issued before the ticket is taken
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for s in range(0, splits):
                total += tl.load(part + s * stride_ws_split, mask=mask, other=0.0, cache_modifier=".cg")
            out = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
            tl.store(out, total.to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    else:
        out = c_ptr + pid_k.to(tl.int64) * stride_ws_split + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["m", "tiles_per_split"])
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, counters_ptr, m, n, k, tiles_per_split,
                     stride_am, stride_asg, stride_bn, stride_bsn, stride_bsk, stride_cm, stride_ws_split,
                     stride_ws_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BN: tl.constexpr,
                     FUSE_QUANT: tl.constexpr, FUSE_REDUCE: tl.constexpr):
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
                        BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN, FUSE_QUANT)
    counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
    _store_tile(acc, c_ptr, ws_ptr, counter, offs_m, row_ok, offs_n, n_ok, pid_k, tl.num_programs(2),
                stride_cm, stride_ws_split, stride_ws_m, FUSE_REDUCE)


@triton.jit
def _row_dot(a_ptr, as_ptr, stride_asg, w_rows, w_scales, row_ok, k, stride_bsk,
             BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, FUSE_QUANT: tl.constexpr, STAGES: tl.constexpr):
    """One activation row (a_ptr: its first channel; as_ptr: its group-0 scale) against BLOCK_N weight rows
    (w_rows: their row pointers; w_scales: their block row's scales), without tensor cores → [BLOCK_N] float32.
    Each loop step loads a [BLOCK_N, GROUPS·128] weight tile and the row's GROUPS groups, folds each group's scales
    into the row (x_q · s_x · s_w, float32) and accumulates the elementwise products; one row sum at the end.
    STAGES > 1: Triton's pipeliner copies the tiles of the next STAGES - 1 steps to shared memory asynchronously
    while this one is summed (a plain loop has a program's loads in flight only between its steps)."""
    BLOCK_K: tl.constexpr = GROUPS * 128
    offs = tl.arange(0, BLOCK_K)
    k_groups = tl.cdiv(k, 128)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for step in tl.range(0, tl.cdiv(k, BLOCK_K), num_stages=STAGES):
        cols = step * BLOCK_K + offs
        k_ok = cols < k
        groups = step * GROUPS + tl.arange(0, GROUPS)
        group_ok = groups < k_groups
        w = tl.load(w_rows[:, None] + cols[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        s_w = tl.load(w_scales + groups * stride_bsk, mask=group_ok, other=0.0)
        if FUSE_QUANT:
            x = tl.load(a_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
            x_q, s_x = _quantize_values(tl.reshape(x, [GROUPS, 128]))
            x_q = x_q.to(tl.float32)
        else:
            x_q = tl.reshape(tl.load(a_ptr + cols, mask=k_ok, other=0.0).to(tl.float32), [GROUPS, 128])
            s_x = tl.load(as_ptr + groups * stride_asg, mask=group_ok, other=0.0)
        x_scaled = tl.reshape(x_q * (s_x * s_w)[:, None], [BLOCK_K])
        acc += w.to(tl.float32) * x_scaled[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _fp8_gemv_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, n, k, stride_asg, stride_bn, stride_bsn, stride_bsk,
                     BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_BN: tl.constexpr, FUSE_QUANT: tl.constexpr,
                     STAGES: tl.constexpr):
    """One activation row against BLOCK_N weight rows (`_row_dot`). BLOCK_N divides the weight block's rows, so
    one weight scale per group serves the whole tile."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    w_rows = b_ptr + rows.to(tl.int64) * stride_bn
    w_scales = bs_ptr + ((pid * BLOCK_N) // SCALE_BN) * stride_bsn
    out = _row_dot(a_ptr, as_ptr, stride_asg, w_rows, w_scales, row_ok, k, stride_bsk, BLOCK_N, GROUPS, FUSE_QUANT,
                   STAGES)
    tl.store(c_ptr + rows, out.to(c_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _fp8_grouped_gemv_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ends_ptr, n, k, stride_am, stride_asg,
                             stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
                             BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_BN: tl.constexpr,
                             FUSE_QUANT: tl.constexpr, STAGES: tl.constexpr):
    """Program (n block, expert): each of the expert's rows (usually one at decode) against BLOCK_N rows of its
    weight (`_row_dot`); an expert without rows reads no weights, one with several reads them once per row."""
    pid_n = tl.program_id(0)
    expert = tl.program_id(1)
    end = tl.load(ends_ptr + expert)
    row = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n
    w_rows = b_ptr + expert.to(tl.int64) * stride_be + cols.to(tl.int64) * stride_bn
    w_scales = bs_ptr + expert.to(tl.int64) * stride_bse + ((pid_n * BLOCK_N) // SCALE_BN) * stride_bsn
    while row < end:  # bounds from device memory: a while loop (see _fp8_grouped_gemm_kernel)
        out = _row_dot(a_ptr + row.to(tl.int64) * stride_am, as_ptr + row, stride_asg, w_rows, w_scales, col_ok, k,
                       stride_bsk, BLOCK_N, GROUPS, FUSE_QUANT, STAGES)
        tl.store(c_ptr + row.to(tl.int64) * stride_cm + cols, out.to(c_ptr.dtype.element_ty), mask=col_ok)
        row += 1


@triton.jit
def _fp8_grouped_gemv_rows_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ends_ptr, n, k, experts, stride_am,
                                  stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
                                  BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SCALE_BN: tl.constexpr,
                                  FUSE_QUANT: tl.constexpr, STAGES: tl.constexpr, EXPERTS_P2: tl.constexpr):
    """Program (n block, row): the row's expert is the number of end offsets ≤ row (the rows are sorted by
    expert), and the row meets BLOCK_N rows of that expert's weight (`_row_dot`). Every program does work — the
    per-expert form launches a program per expert, most of which exit at once at decode — and its loop is the
    kernel's only loop, so STAGES > 1 pipelines the weight tiles. Rows past end[E-1] are not written."""
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    e_offs = tl.arange(0, EXPERTS_P2)
    ends = tl.load(ends_ptr + e_offs, mask=e_offs < experts, other=0x7FFFFFFF)
    expert = tl.sum((ends <= row).to(tl.int32), axis=0)
    if expert < experts:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        w_rows = b_ptr + expert.to(tl.int64) * stride_be + cols.to(tl.int64) * stride_bn
        w_scales = bs_ptr + expert.to(tl.int64) * stride_bse + ((pid_n * BLOCK_N) // SCALE_BN) * stride_bsn
        out = _row_dot(a_ptr + row.to(tl.int64) * stride_am, as_ptr + row, stride_asg, w_rows, w_scales, col_ok, k,
                       stride_bsk, BLOCK_N, GROUPS, FUSE_QUANT, STAGES)
        tl.store(c_ptr + row.to(tl.int64) * stride_cm + cols, out.to(c_ptr.dtype.element_ty), mask=col_ok)


@triton.jit(do_not_specialize=["tiles_per_split", "m_progs", "counters_per_column"])
def _fp8_grouped_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, ws_ptr, counters_ptr, ends_ptr, n, k,
                             tiles_per_split, m_progs, counters_per_column,
                             stride_am, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                             stride_cm, stride_ws_split, stride_ws_m,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SCALE_BN: tl.constexpr, FUSE_QUANT: tl.constexpr, FUSE_REDUCE: tl.constexpr,
                             SPLIT_K: tl.constexpr, REVERSED: tl.constexpr):
    pid_n = tl.program_id(0)
    expert = tl.program_id(1) // m_progs
    if REVERSED:  # the last expert's programs start first (see TritonGemmConfig.experts_reversed)
        expert = tl.num_programs(1) // m_progs - 1 - expert
    part = tl.program_id(1) % m_progs
    pid_k = tl.program_id(2)
    end = tl.load(ends_ptr + expert)
    start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    if SPLIT_K:  # noqa: SIM108 -- a statement-level constexpr branch: the form measured on the GPU
        t_start = pid_k * tiles_per_split
    else:  # without split-K the first tile is the constant 0: 4-10 % faster at decode's shapes (H200, 2026-11-28)
        t_start = 0
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
                            BLOCK_M, BLOCK_N, BLOCK_K, SCALE_BN, FUSE_QUANT)
        # Counter of this (expert, row tile): start // BLOCK_M + expert + tile index is distinct for every pair
        # (an expert's tiles end before the next expert's first index) and below cdiv(M, BLOCK_M) + E.
        tile = start // BLOCK_M + expert + (m0 - start) // BLOCK_M
        counter = counters_ptr + pid_n * counters_per_column + tile
        _store_tile(acc, c_ptr, ws_ptr, counter, offs_m, row_ok, offs_n, n_ok, pid_k, tl.num_programs(2),
                    stride_cm, stride_ws_split, stride_ws_m, FUSE_REDUCE)
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


_COUNTERS_MIN = 1 << 16
_counters: dict[tuple[str, int, int], torch.Tensor] = {}
_outgrown: list[torch.Tensor] = []  # buffers replaced by larger ones: captured CUDA graphs may still use them


def _tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """A zeroed int32 buffer of ≥ `count` tile counters for the current stream of `device`. Every fused-reduce
    kernel leaves its counters at 0 when it ends, so the buffer is reused by every call on the stream (the
    calls of one stream never overlap; another stream gets its own buffer). Allocated on first use — inside a
    CUDA-graph capture too: the tensor is kept for the life of the process, so a captured graph's pointer to it
    stays valid — and replaced by a larger zeroed buffer for a larger grid (the old one kept alive likewise)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = ("cuda", index, torch.cuda.current_stream(index).cuda_stream)
        where = torch.device("cuda", index)
    else:  # Triton's CPU interpreter (the CPU tests)
        key, where = (device.type, 0, 0), device
    buffer = _counters.get(key)
    if buffer is None or buffer.numel() < count:
        if buffer is not None:
            _outgrown.append(buffer)
        size = max(_COUNTERS_MIN, 1 << max(0, count - 1).bit_length())
        buffer = torch.zeros(size, dtype=torch.int32, device=where)
        _counters[key] = buffer
    return buffer


def _outputs(rows: int, n: int, splits: int, fuse_reduce: bool, out_dtype: torch.dtype,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(what the kernel writes its tiles to, float32 split-K partials or the same tensor when there are none).
    Without fused reduction the partials are the kernel's output and `_reduce` sums them afterwards."""
    if splits == 1:
        out = torch.empty(rows, n, dtype=out_dtype, device=device)
        return out, out
    partials = torch.empty(splits, rows, n, dtype=torch.float32, device=device)
    if fuse_reduce:
        return torch.empty(rows, n, dtype=out_dtype, device=device), partials
    return partials, partials


def _store_args(target: torch.Tensor, partials: torch.Tensor, splits: int,
                fuse_reduce: bool) -> tuple[int, int, int]:
    """(stride_cm, stride_ws_split, stride_ws_m) of `_store_tile` for the tensors of `_outputs`."""
    if fuse_reduce:
        return target.stride(0), partials.stride(0), partials.stride(1)
    return target.stride(-2), (target.stride(0) if splits > 1 else 0), 0


def _reduce(partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    if partials.dim() == 2:
        return partials
    splits, rows, n = partials.shape
    out = torch.empty(rows, n, dtype=out_dtype, device=partials.device)
    numel = rows * n
    if numel:
        _splitk_sum_kernel[(triton.cdiv(numel, _REDUCE_BLOCK),)](partials, out, numel, splits, BLOCK=_REDUCE_BLOCK)
    return out


def _activation_args(a: torch.Tensor, a_scales: torch.Tensor | None,
                     config: TritonGemmConfig) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(activation pointer, scale pointer, scale group stride) for the kernels: the quantized rows and their
    scales, or with fuse_quant the unquantized rows (the scale pointer is then unused)."""
    if config.fuse_quant:
        if a.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a_scales is not None:
            raise ValueError(f"fuse_quant takes the unquantized activations and no scales; got {a.dtype}")
        return a, a, 0
    if a_scales is None or a.dtype != torch.float8_e4m3fn:
        raise ValueError(f"quantized activations (float8_e4m3fn) and their scales are required; got {a.dtype}")
    return a, a_scales, a_scales.stride(0)


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


def fp8_gemm(a: torch.Tensor, a_scales: torch.Tensor | None, m: int, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: TritonGemmConfig, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """(a [≥m, K] e4m3, a_scales [G, ≥m] group-major) @ dequant(w [N, K])ᵀ → [m, N] out_dtype. With
    `config.fuse_quant`, a is the unquantized activations (bf16/fp16/fp32, last dim contiguous) and a_scales None."""
    if config.fuse_quant and a.stride(-1) != 1:
        a = a.contiguous()
    k = a.shape[1]
    _check_weight(w, w_scale, k, block)
    a_arg, s_arg, stride_asg = _activation_args(a, a_scales, config)
    n = w.shape[0]
    splits, per_split = _splits(k, config.split_k)
    fuse_reduce = bool(config.fuse_reduce and splits > 1 and m and n)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), splits)
    counters = _tile_counters(a.device, grid[0] * grid[1]) if fuse_reduce else None
    target, partials = _outputs(m, n, splits, fuse_reduce, out_dtype, a.device)
    if m and n:
        stride_cm, stride_ws_split, stride_ws_m = _store_args(target, partials, splits, fuse_reduce)
        _fp8_gemm_kernel[grid](
            a_arg, s_arg, w, w_scale, target, partials, counters if counters is not None else target, m, n, k,
            per_split, a.stride(0), stride_asg, w.stride(0), w_scale.stride(0), w_scale.stride(1),
            stride_cm, stride_ws_split, stride_ws_m,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=GROUP, SCALE_BN=block[0],
            FUSE_QUANT=config.fuse_quant, FUSE_REDUCE=fuse_reduce,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    return target if fuse_reduce else _reduce(target, out_dtype)


def _gemv_operands(a: torch.Tensor, a_scales: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                   config: TritonGemmConfig, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, int, dict]:
    """Checks shared by the one-row kernels → (activation pointer, scale pointer, scale group stride, launch
    meta-parameters)."""
    if not config.gemv_groups:
        raise ValueError(f"the one-row kernels take a gemv configuration, got {config.label()}")
    if block[0] % config.block_n:
        raise ValueError(f"BLOCK_N {config.block_n} must divide the weight block's {block[0]} rows")
    if config.fuse_quant and a.stride(-1) != 1:
        a = a.contiguous()
    _check_weight(w, w_scale, a.shape[1], block)
    a_arg, s_arg, stride_asg = _activation_args(a, a_scales, config)
    meta = {"BLOCK_N": config.block_n, "GROUPS": config.gemv_groups, "SCALE_BN": block[0],
            "FUSE_QUANT": config.fuse_quant, "STAGES": config.gemv_stages, "num_warps": config.num_warps}
    return a_arg, s_arg, stride_asg, meta


def fp8_gemv(a: torch.Tensor, a_scales: torch.Tensor | None, m: int, w: torch.Tensor, w_scale: torch.Tensor,
             out_dtype: torch.dtype, config: TritonGemmConfig, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """`fp8_gemm` for one row (m ≤ 1: decode at batch 1) with the one-row kernel `config` describes
    (`gemv_groups` > 0): (a [≥1, K] e4m3, a_scales [G, ≥1]) or, with `config.fuse_quant`, the unquantized row."""
    if m > 1:
        raise ValueError(f"fp8_gemv takes one row, got m={m}")
    if config.gemv_row_programs:
        raise ValueError(f"the row-program form is the grouped kernel's, got {config.label()} for a dense GEMM")
    a_arg, s_arg, stride_asg, meta = _gemv_operands(a, a_scales, w, w_scale, config, block)
    n, k = w.shape
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m and n:
        _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
            a_arg, s_arg, w, w_scale, out, n, k, stride_asg, w.stride(0), w_scale.stride(0), w_scale.stride(1),
            **meta)
    return out


def fp8_grouped_gemv(a: torch.Tensor, a_scales: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                     end_offsets: torch.Tensor, out_dtype: torch.dtype, config: TritonGemmConfig,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """`fp8_grouped_gemm` with the one-row kernel (`config.gemv_groups` > 0): each expert's rows one at a time, for
    decode's few rows per expert; same arguments and contract (rows past end_offsets[E-1] left undefined). Two
    launch forms with the same arithmetic, so the same bits: a program per (column block, expert) walking the
    expert's rows, or with `config.gemv_row_programs` a program per (column block, row)."""
    if w.dim() != 3 or w_scale.dim() != 3 or end_offsets.numel() != w.shape[0]:
        raise ValueError(f"grouped weights must be [E, N, K] with E end offsets; got {tuple(w.shape)}, "
                         f"{tuple(w_scale.shape)}, {end_offsets.numel()} offsets")
    a_arg, s_arg, stride_asg, meta = _gemv_operands(a, a_scales, w, w_scale, config, block)
    experts, n, k = w.shape
    m = a.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not (m and n and experts):
        return out
    if config.gemv_row_programs:
        if m > MAX_GRID_Y:
            raise ValueError(f"the row-program form takes at most {MAX_GRID_Y} rows, got {m}")
        _fp8_grouped_gemv_rows_kernel[(triton.cdiv(n, config.block_n), m)](
            a_arg, s_arg, w, w_scale, out, end_offsets, n, k, experts, a_arg.stride(0), stride_asg,
            w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0),
            EXPERTS_P2=triton.next_power_of_2(experts), **meta)
    else:
        _fp8_grouped_gemv_kernel[(triton.cdiv(n, config.block_n), experts)](
            a_arg, s_arg, w, w_scale, out, end_offsets, n, k, a_arg.stride(0), stride_asg,
            w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), w_scale.stride(2), out.stride(0), **meta)
    return out


def fp8_grouped_gemm(a: torch.Tensor, a_scales: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor,
                     end_offsets: torch.Tensor, out_dtype: torch.dtype, config: TritonGemmConfig,
                     block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Rows of a [M, K] (a_scales [G, M] group-major; with `config.fuse_quant` a is unquantized and a_scales
    None) sorted by expert; expert e (weight w[e] [N, K], scales w_scale[e]) owns rows [end_offsets[e-1],
    end_offsets[e]) (int32 [E], on the device) → [M, N] out_dtype; rows past end_offsets[E-1] are left undefined."""
    if config.fuse_quant and a.stride(-1) != 1:
        a = a.contiguous()
    m, k = a.shape
    _check_weight(w, w_scale, k, block)
    if w.dim() != 3 or w_scale.dim() != 3 or end_offsets.numel() != w.shape[0]:
        raise ValueError(f"grouped weights must be [E, N, K] with E end offsets; got {tuple(w.shape)}, "
                         f"{tuple(w_scale.shape)}, {end_offsets.numel()} offsets")
    a_arg, s_arg, stride_asg = _activation_args(a, a_scales, config)
    experts, n = w.shape[0], w.shape[1]
    splits, per_split = _splits(k, config.split_k)
    fuse_reduce = bool(config.fuse_reduce and splits > 1 and m and n and experts)
    grid = (triton.cdiv(n, config.block_n), experts * config.m_programs, splits)
    per_column = triton.cdiv(m, config.block_m) + experts
    counters = _tile_counters(a.device, grid[0] * per_column) if fuse_reduce else None
    target, partials = _outputs(m, n, splits, fuse_reduce, out_dtype, a.device)
    if m and n and experts:
        stride_cm, stride_ws_split, stride_ws_m = _store_args(target, partials, splits, fuse_reduce)
        _fp8_grouped_gemm_kernel[grid](
            a_arg, s_arg, w, w_scale, target, partials, counters if counters is not None else target, end_offsets,
            n, k, per_split, config.m_programs, per_column,
            a.stride(0), stride_asg, w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
            w_scale.stride(2), stride_cm, stride_ws_split, stride_ws_m,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=GROUP, SCALE_BN=block[0],
            FUSE_QUANT=config.fuse_quant, FUSE_REDUCE=fuse_reduce, SPLIT_K=splits > 1,
            REVERSED=config.experts_reversed, num_warps=config.num_warps, num_stages=config.num_stages,
            **({"maxnreg": config.max_registers} if config.max_registers else {}),
        )
    return target if fuse_reduce else _reduce(target, out_dtype)
