"""The lightning indexer's query and key chains, each as one Triton kernel on CUDA: RoPE on the first 64 dims,
the normalized Walsh–Hadamard rotation of the 128 dims, then the query's e4m3 quantization (the form the fp8
scores kernel reads, kernels/indexer_fast.py) or the keys' FP8 packing (e4m3 + power-of-two scale,
kernels/fp8_quant_triton.py).

Why: eager, the query's chain is a cast, a rotary kernel, a 128×128 GEMM (cuBLAS picks split-K: two kernels) and
the quantization; the keys' a rotary kernel, a GEMV and the packing — ~7 launches a layer of 1–4 µs each at
decode batch sizes (docs/kernels.md "The indexer's rotation").

Numerics: the eager reference (decode_server/model/indexer.py: `rotate_index_heads`) rotates by the fast
Walsh–Hadamard transform — seven stages of float32 adds and subtracts in a fixed order, then one multiply by
float32(128^-0.5) — and each kernel here runs the same operations in the same order (register tiles reshaped so
that each stage pairs the same elements), with FMA contraction off, so the bits are eager's. RoPE rounds each
product and each sum as eager's separate tensor ops do. Rows are independent: batch invariant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp8_quant_triton import _libdevice, _quantize_tiles
from kernels.indexer_fast import _round_to_e4m3, _scale_heads

HEAD_DIM = 128
ROPE_DIM = 64
INV_SQRT_HEAD_DIM = 0.08838834764831845  # 128^-0.5, rounded to float32 where it multiplies
QUERY_HEADS_BLOCK = 16  # heads per program of the query's kernel


@triton.jit
def _rope_rows(x, cos, sin, ROWS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """x [ROWS, 128] float32 with its first 64 dims rotated by cos / sin [32]: pairs (2j, 2j+1) if INTERLEAVED,
    else (j, j + 32). Each product and sum rounded as eager's tensor ops round them (launch without FMA)."""
    y = tl.permute(tl.reshape(x, (ROWS, 2, 64)), (0, 2, 1))
    rope, rest = tl.split(y)  # dims 0..63, dims 64..127
    if INTERLEAVED:
        first, second = tl.split(tl.reshape(rope, (ROWS, 32, 2)))
    else:
        first, second = tl.split(tl.permute(tl.reshape(rope, (ROWS, 2, 32)), (0, 2, 1)))
    c = cos[None, :]
    s = sin[None, :]
    out_first = first * c - second * s
    out_second = second * c + first * s
    pairs = tl.join(out_first, out_second)  # [ROWS, 32, 2]
    if INTERLEAVED:
        rope = tl.reshape(pairs, (ROWS, 64))
    else:
        rope = tl.reshape(tl.permute(pairs, (0, 2, 1)), (ROWS, 64))
    return tl.reshape(tl.permute(tl.join(rope, rest), (0, 2, 1)), (ROWS, 128))


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, STRIDE: tl.constexpr):
    """One stage of the fast Walsh–Hadamard transform: (x[i], x[i + STRIDE]) → (sum, difference) within blocks
    of 2·STRIDE."""
    y = tl.permute(tl.reshape(x, (ROWS, 128 // (2 * STRIDE), 2, STRIDE)), (0, 1, 3, 2))
    a, b = tl.split(y)
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, (ROWS, 128))


@triton.jit
def _walsh_hadamard(x, ROWS: tl.constexpr):
    """x [ROWS, 128] float32 @ the normalized Sylvester Hadamard matrix, in eager's order of operations."""
    x = _butterfly(x, ROWS, 1)
    x = _butterfly(x, ROWS, 2)
    x = _butterfly(x, ROWS, 4)
    x = _butterfly(x, ROWS, 8)
    x = _butterfly(x, ROWS, 16)
    x = _butterfly(x, ROWS, 32)
    x = _butterfly(x, ROWS, 64)
    return x * 0.08838834764831845  # INV_SQRT_HEAD_DIM


@triton.jit
def _index_query_kernel(q_ptr, stride_qt, stride_qh, cos_ptr, sin_ptr, cs_stride, w_ptr, stride_wt, q_out_ptr,
                        w_out_ptr, num_heads, weight_scale, HEADS_BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
                        QUANTIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HEADS_BLOCK + tl.arange(0, HEADS_BLOCK)
    dims = tl.arange(0, 128)  # HEAD_DIM
    half = tl.arange(0, 32)
    head_ok = heads < num_heads
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=head_ok[:, None],
                other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * cs_stride + half).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_stride + half).to(tl.float32)
    q = _walsh_hadamard(_rope_rows(q, cos, sin, HEADS_BLOCK, INTERLEAVED), HEADS_BLOCK)
    # The product as torch's `weights * weight_scale` rounds it (float32).
    w = tl.load(w_ptr + t * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32) * weight_scale
    out = q_out_ptr + t * num_heads * 128 + heads[:, None] * 128 + dims[None, :]
    if QUANTIZE:  # the fp8 scores kernel's own operand (kernels/indexer_fast.py, `quantize_query`)
        q, w = _scale_heads(q, w, 2)
        tl.store(out, _round_to_e4m3(q).to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=head_ok[:, None])
    else:
        tl.store(out, q, mask=head_ok[:, None])
    tl.store(w_out_ptr + t * num_heads + heads, w, mask=head_ok)


@triton.jit
def _index_keys_kernel(k_ptr, stride_kt, cos_ptr, sin_ptr, cs_stride, keys_ptr, scales_ptr,
                       INTERLEAVED: tl.constexpr, LIBDEVICE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, 128)  # HEAD_DIM
    half = tl.arange(0, 32)
    k = tl.reshape(tl.load(k_ptr + t * stride_kt + dims).to(tl.float32), (1, 128))
    cos = tl.load(cos_ptr + t * cs_stride + half).to(tl.float32)
    sin = tl.load(sin_ptr + t * cs_stride + half).to(tl.float32)
    k = _walsh_hadamard(_rope_rows(k, cos, sin, 1, INTERLEAVED), 1)
    keys, scale = _quantize_tiles(k, LIBDEVICE)
    tl.store(keys_ptr + t * 128 + dims, tl.reshape(keys, (128,)))
    tl.store(scales_ptr + t + tl.arange(0, 1), scale)


def supports(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int) -> bool:
    """The kernels' shapes: 128-dim heads (x [T, H, 128] or [T, 128], unit inner stride), 64 rotary dims, cos /
    sin [T, 32] with unit inner stride, at least one token."""
    return (x.is_cuda and x.shape[-1] == HEAD_DIM and x.stride(-1) == 1 and rope_dim == ROPE_DIM
            and x.shape[0] > 0 and cos.dim() == 2 and cos.shape == (x.shape[0], ROPE_DIM // 2)
            and cos.stride(-1) == 1 and sin.shape == cos.shape and sin.stride() == cos.stride())


def index_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, weights: torch.Tensor,
                weight_scale: float, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, 128] (any float dtype: wq_b's output) → rotary on the first 64 dims, the Hadamard rotation, and
    then, with `quantize`, (e4m3 q, weights · weight_scale · 2^-s per head) as `indexer_fast.quantize_query`
    gives them, else (float32 q, weights · weight_scale). One launch; eager's bits (module docstring)."""
    num_q, heads, _ = q.shape
    q_out = torch.empty((num_q, heads, HEAD_DIM), dtype=torch.float8_e4m3fn if quantize else torch.float32,
                        device=q.device)
    w_out = torch.empty((num_q, heads), dtype=torch.float32, device=q.device)
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    heads_block = min(QUERY_HEADS_BLOCK, triton.next_power_of_2(heads))
    _index_query_kernel[(num_q, triton.cdiv(heads, heads_block))](
        q, q.stride(0), q.stride(1), cos, sin, cos.stride(0), weights, weights.stride(0),
        q_out.view(torch.uint8) if quantize else q_out, w_out, heads, float(weight_scale),
        HEADS_BLOCK=heads_block, INTERLEAVED=interleaved, QUANTIZE=quantize, num_warps=4, enable_fp_fusion=False,
    )
    return q_out, w_out


def index_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """k [T, 128] (normalized wk output) → rotary on the first 64 dims, the Hadamard rotation, the FP8 packing:
    ([T, 128] float8_e4m3fn, [T] float32 power-of-two scales), as eager's three steps give them."""
    num = k.shape[0]
    keys = torch.empty((num, HEAD_DIM), dtype=torch.float8_e4m3fn, device=k.device)
    scales = torch.empty((num,), dtype=torch.float32, device=k.device)
    _index_keys_kernel[(num,)](k, k.stride(0), cos, sin, cos.stride(0), keys, scales, INTERLEAVED=interleaved,
                               LIBDEVICE=_libdevice(), num_warps=1, enable_fp_fusion=False)
    return keys, scales
