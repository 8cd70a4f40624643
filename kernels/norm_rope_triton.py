"""One-kernel RMSNorm (optionally with the residual add before it) and rotary embedding for CUDA tensors.

Why: in eager PyTorch an RMSNorm is eight kernels (cast, square, mean, add eps, rsqrt, scale, cast, weight) and
a rotary embedding of a strided slice another eight or so (two strided halves, four products, a sum and a
difference, a stack and a copy). A decode step at small batch is a chain of such launches: on `dsv32-bench-16l`
(batch 1, FP8 weights, H200) the step ran 2517 kernels, of which these made ~900 (docs/benchmarks.md). Each
function here is one launch that reads its input once.

Numerics (the references are `decode_server.model.layers.RMSNorm._normalize` and
`decode_server.model.rope.apply_rope_*`, which the CPU keeps running):
- `rope_interleaved` / `rope_half_split` give **the same bits** as the eager references: every product and sum
  is rounded to the output dtype where eager rounds it (each eager op rounds its result), and floating-point
  contraction (FMA) is off for these kernels (`enable_fp_fusion=False`).
- `rms_norm` differs from eager only in the order of the float32 sum of squares (one row per program, Triton's
  tree reduction) and in rsqrt's last bit; the cast to the input dtype before the weight, the weight product in
  the result dtype and, for `add_rms_norm`, the residual sum rounded to the input dtype (what `x + delta`
  gives) are eager's. Each row depends only on itself, so it is batch invariant (`--enable-deterministic-inference`).
- `quantize=True` also writes the norm's output as a block-FP8 GEMM reads it (e4m3 values and a float32 scale per
  row and 128-channel group, kernels/fp8_gemm_triton.py `quantize_activations`' layout) and attaches it to the
  output (kernels/fp8_gemm.py `attach_quantized`): the values quantized are the stored output's, by the same
  `_quantize_values`, so they are the quantization kernel's bits, and the FP8 GEMM after the norm needs no
  quantization launch of its own (one launch fewer per norm in a decode step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_gemm import attach_quantized
from kernels.fp8_gemm_triton import GROUP, _quantize_values

MAX_NORM_WIDTH = 16384  # one row per program, held in registers
_GROUP_C = tl.constexpr(GROUP)  # a kernel reads module globals only as constexprs
QUANT_PART_GROUPS = 8  # 128-channel groups a program of the quantizing norm normalizes and quantizes


@triton.jit
def _rms_norm_kernel(x_ptr, x_stride, d_ptr, d_stride, sum_ptr, sum_stride, w_ptr, out_ptr, out_stride, n, eps,
                     HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_square = tl.sum(x32 * x32, axis=0) / n
    normed = (x32 * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_quant_kernel(x_ptr, x_stride, d_ptr, d_stride, sum_ptr, sum_stride, w_ptr, out_ptr, out_stride, n, eps,
                           q_ptr, q_stride, s_ptr, s_stride,
                           HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, PART_GROUPS: tl.constexpr):
    """`_rms_norm_kernel` that also writes its output's block-FP8 form, as programs (row, part): each program sums
    the squares of the whole row, exactly as `_rms_norm_kernel` does (same code, block and warps: the same
    reduction, so the same bits), then normalizes, stores and quantizes only its part, PART_GROUPS 128-channel
    groups, in a [groups, 128] layout. Why parts: a row's quantization in one program ran on one SM for ~3 µs at
    7168 channels (H200), more than the quantization launch it spares; the parts spread it over the GPU."""
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * d_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n + eps)
    groups = part * PART_GROUPS + tl.arange(0, PART_GROUPS)
    pcols = groups[:, None] * _GROUP_C + tl.arange(0, _GROUP_C)[None, :]
    pmask = pcols < n
    xp = tl.load(x_ptr + row * x_stride + pcols, mask=pmask, other=0.0)
    if HAS_DELTA:
        dp = tl.load(d_ptr + row * d_stride + pcols, mask=pmask, other=0.0)
        xp = (xp.to(tl.float32) + dp.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + pcols, xp, mask=pmask)
    normed = (xp.to(tl.float32) * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + pcols, mask=pmask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride + pcols, y, mask=pmask)
    # The stored values (columns past n are zeros, as the quantization kernel's masked loads give).
    q, scale = _quantize_values(y.to(tl.float32))
    tl.store(q_ptr + row * q_stride + pcols, q, mask=pmask)
    tl.store(s_ptr + groups * s_stride + row, scale, mask=groups < tl.cdiv(n, _GROUP_C))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n] without a copy where its layout allows (last dim contiguous, leading dims collapsible)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def supports_quantized_output(x: torch.Tensor) -> bool:
    """Whether `rms_norm` / `add_rms_norm` can also write x's normed rows in block FP8 (`quantize=True`): whole
    128-channel groups (one program holds a row, so its groups are whole in registers)."""
    return x.shape[-1] % GROUP == 0 and x.shape[-1] >= GROUP


def supports_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.is_cuda and x.dim() >= 2 and x.shape[-1] <= MAX_NORM_WIDTH and x.stride(-1) == 1
            and weight.is_contiguous() and weight.shape == x.shape[-1:] and x.numel() > 0
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32))


def _launch_norm(x2: torch.Tensor, delta2: torch.Tensor | None, summed: torch.Tensor | None,
                 weight: torch.Tensor, eps: float, out: torch.Tensor,
                 quantized: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    n = x2.shape[1]
    block = triton.next_power_of_2(n)
    warps = max(1, min(16, block // 512))  # the quantizing kernel's too: its row sum must be this kernel's
    args = (x2, x2.stride(0), delta2 if delta2 is not None else x2, delta2.stride(0) if delta2 is not None else 0,
            summed if summed is not None else x2, summed.stride(0) if summed is not None else 0,
            weight, out, out.stride(0), n, eps)
    if quantized is None:
        _rms_norm_kernel[(x2.shape[0],)](*args, HAS_DELTA=delta2 is not None, BLOCK=block, num_warps=warps)
        return
    q, scales = quantized
    part_groups = min(QUANT_PART_GROUPS, block // GROUP)
    _rms_norm_quant_kernel[(x2.shape[0], triton.cdiv(triton.cdiv(n, GROUP), part_groups))](
        *args, q, q.stride(0), scales, scales.stride(0), HAS_DELTA=delta2 is not None, BLOCK=block,
        PART_GROUPS=part_groups, num_warps=warps)


def _quantized_buffers(rows: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [rows, n] e4m3, scales [n / 128, rows] float32): `quantize_activations`' layout without row padding."""
    return (torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(n // GROUP, rows, dtype=torch.float32, device=device))


def _normed_output(x2: torch.Tensor, delta2: torch.Tensor | None, summed: torch.Tensor | None,
                   weight: torch.Tensor, eps: float, shape: torch.Size, quantize: bool) -> torch.Tensor:
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, x2), device=x2.device)
    quantized = _quantized_buffers(*x2.shape, x2.device) if quantize else None
    if quantize and not supports_quantized_output(x2):
        raise ValueError(f"quantize=True needs whole 128-channel groups, got width {x2.shape[1]}")
    _launch_norm(x2, delta2, summed, weight, eps, out, quantized)
    normed = out.view(shape)
    if quantized is not None and normed.dim() == 2:
        attach_quantized(normed, *quantized)
    return normed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             quantize: bool = False) -> torch.Tensor:
    """weight · (x / rms(x)) over the last dim, in the dtype eager's `weight * normed.to(x.dtype)` gives; into
    `out` ([rows, n], last dim contiguous, e.g. a column slice of a larger tensor) if given. `quantize` (2-D x,
    no `out`): the result also carries its block-FP8 form (module docstring)."""
    x2 = _rows(x)
    if out is None:
        return _normed_output(x2, None, None, weight, eps, x.shape, quantize)
    if quantize:
        raise ValueError("quantize=True writes a fresh output; it does not take `out`")
    _launch_norm(x2, None, None, weight, eps, out)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, rms_norm(x + delta)) in one pass: the residual stream's add and the next norm (with its
    block-FP8 form attached where `quantize`)."""
    x2, d2 = _rows(x), _rows(delta)
    summed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    return summed.view(x.shape), _normed_output(x2, d2, summed, weight, eps, x.shape, quantize)


@triton.jit
def _rope_kernel(x_ptr, x_tok_stride, x_head_stride, cos_ptr, sin_ptr, cs_stride, out_ptr, out_tok_stride,
                 out_head_stride, heads, INTERLEAVED: tl.constexpr, HALF: tl.constexpr, HEADS_BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)[:, None]
    j = tl.arange(0, HALF)[None, :]
    hmask = head < heads
    if INTERLEAVED:
        first_off, second_off = 2 * j, 2 * j + 1
    else:
        first_off, second_off = j, j + HALF
    src = x_ptr + token * x_tok_stride + head * x_head_stride
    a = tl.load(src + first_off, mask=hmask, other=0.0)
    b = tl.load(src + second_off, mask=hmask, other=0.0)
    c = tl.load(cos_ptr + token * cs_stride + j)
    s = tl.load(sin_ptr + token * cs_stride + j)
    ty = out_ptr.dtype.element_ty
    a32, b32, c32, s32 = a.to(tl.float32), b.to(tl.float32), c.to(tl.float32), s.to(tl.float32)
    # Each product and sum rounded to the result dtype, as eager's separate ops round them.
    first = ((a32 * c32).to(ty).to(tl.float32) - (b32 * s32).to(ty).to(tl.float32)).to(ty)
    second = ((b32 * c32).to(ty).to(tl.float32) + (a32 * s32).to(ty).to(tl.float32)).to(ty)
    dst = out_ptr + token * out_tok_stride + head * out_head_stride
    tl.store(dst + first_off, first, mask=hmask)
    tl.store(dst + second_off, second, mask=hmask)


def _as_heads(x: torch.Tensor) -> torch.Tensor:
    """[T, d] or [T, H, d] as [T, H, d] (a view)."""
    return x.unsqueeze(1) if x.dim() == 2 else x


def supports_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    d = x.shape[-1]
    ok = (x.is_cuda and x.dim() in (2, 3) and x.stride(-1) == 1 and d % 2 == 0 and d & (d - 1) == 0
          and cos.dim() == 2 and cos.shape == sin.shape and cos.shape == (x.shape[0], d // 2)
          and cos.stride(-1) == 1 and sin.stride() == cos.stride() and x.shape[0] > 0)
    if out is not None:
        ok = ok and out.shape == x.shape and out.stride(-1) == 1 and out.dtype == torch.result_type(x, cos)
    return ok


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] or [T, H, d] rotated by cos/sin [T, d/2], into `out` (same shape; may be x itself, or a strided
    slice of a larger tensor) or a new tensor. Pairs are (2j, 2j+1) if `interleaved`, else (j, j + d/2)."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.result_type(x, cos), device=x.device)
    x3, o3 = _as_heads(x), _as_heads(out)
    heads = x3.shape[1]
    heads_block = min(triton.next_power_of_2(heads), 16)
    grid = (x3.shape[0], triton.cdiv(heads, heads_block))
    _rope_kernel[grid](x3, x3.stride(0), x3.stride(1), cos, sin, cos.stride(0), o3, o3.stride(0), o3.stride(1),
                       heads, INTERLEAVED=interleaved, HALF=x.shape[-1] // 2, HEADS_BLOCK=heads_block,
                       num_warps=4 if heads_block >= 8 else 1, enable_fp_fusion=False)
    return out
