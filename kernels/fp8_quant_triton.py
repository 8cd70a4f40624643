"""One-kernel FP8 quantization with power-of-two scales, for CUDA tensors: the indexer's keys and the 656-byte
FP8 MLA KV rows.

Why: eager, `kernels.indexer_ref.quantize_index_keys` is ~10 kernels (abs, amax, clamp, the scale's divide,
log2, ceil, exp2, the values' divide, clamp, the FP8 cast) and `kernels.fp8_rows.pack_fp8_rows` ~13 (the same
plus the three slice writes of the row's parts). Every decode layer runs both once: ~32 µs a layer at batch 1 on
an H200 (a rank's 61 layers: ~2 ms of a ~29 ms step; docs/benchmarks.md). Each function here is one launch, one
program per row.

Numerics: the same bits as the eager references (tests/model/test_fused_ops_gpu.py holds them to it, near powers
of two included). amax is exact; the scale is `exp2(ceil(log2(max(amax, 1e-4) / 448)))` with the divide as
torch's CUDA kernel does it (a product with float32(1 / 448): a correctly rounded divide differs where the
quotient sits just above a power of two) and CUDA's own `log2f` / `exp2f` / `ceilf` (libdevice); the values are
multiplied by the scale's exact reciprocal (a power of two, so the same as eager's divide), clamped to ±448 and
rounded to e4m3 to nearest even, as torch's cast rounds. The RoPE part of a KV row is cast to bf16 (round to
nearest even, as `.to(torch.bfloat16)`). Rows are independent: batch invariant.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kernels.fp8_rows import FP8_ROW_BYTES, NOPE_DIM, NUM_TILES, ROPE_DIM, ROPE_OFFSET, SCALE_OFFSET, TILE
from kernels.indexer_ref import FP8_MAX, INDEX_HEAD_DIM

AMAX_FLOOR = 1e-4  # kernels.indexer_ref.pow2_scale's floor


@triton.jit
def _pow2_scale(amax, LIBDEVICE: tl.constexpr):
    """kernels.indexer_ref.pow2_scale, bit for bit with LIBDEVICE (CUDA's log2f / ceilf / exp2f, as torch's
    kernels call them; the GPU tests cover scales at, just above and just below powers of two). Triton's
    interpreter has no libdevice: it takes tl's log2 / exp2 / ceil (numpy's), equal away from those edges."""
    # torch divides a tensor by a Python scalar as a product with the scalar's float32 reciprocal (CUDA)
    scale = tl.maximum(amax, 1e-4) * 0.0022321429569274187
    if LIBDEVICE:
        return libdevice.exp2(libdevice.ceil(libdevice.log2(scale)))
    else:
        return tl.exp2(tl.ceil(tl.log2(scale)))


@triton.jit
def _quantize_tiles(x, LIBDEVICE: tl.constexpr):
    """x [TILES, TILE] float32 → (e4m3 values, [TILES] float32 scales)."""
    scale = _pow2_scale(tl.max(tl.abs(x), axis=1), LIBDEVICE)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)  # exact: a power of two
    q = tl.clamp(x * inv[:, None], -448.0, 448.0).to(tl.float8e4nv)
    return q, scale


@triton.jit
def _index_keys_kernel(x_ptr, x_stride, q_ptr, scale_ptr, DIM: tl.constexpr, LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, DIM)
    x = tl.load(x_ptr + row * x_stride + cols).to(tl.float32)
    q, scale = _quantize_tiles(tl.reshape(x, (1, DIM)), LIBDEVICE)
    tl.store(q_ptr + row * DIM + cols, tl.reshape(q, (DIM,)))
    tl.store(scale_ptr + row + tl.arange(0, 1), scale)


@triton.jit
def _pack_rows_kernel(x_ptr, x_stride, out_ptr, TILES: tl.constexpr, TILE_: tl.constexpr, ROPE: tl.constexpr,
                      ROW_BYTES: tl.constexpr, SCALE_AT: tl.constexpr, ROPE_AT: tl.constexpr,
                      LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = x_ptr + row * x_stride
    dst = out_ptr + row * ROW_BYTES
    tiles = tl.arange(0, TILES)
    cols = tl.arange(0, TILE_)
    x = tl.load(src + tiles[:, None] * TILE_ + cols[None, :]).to(tl.float32)
    q, scale = _quantize_tiles(x, LIBDEVICE)
    tl.store((dst).to(tl.pointer_type(tl.float8e4nv)) + tiles[:, None] * TILE_ + cols[None, :], q)
    tl.store((dst + SCALE_AT).to(tl.pointer_type(tl.float32)) + tiles, scale)
    rope_cols = tl.arange(0, ROPE)
    rope = tl.load(src + TILES * TILE_ + rope_cols)
    tl.store((dst + ROPE_AT).to(tl.pointer_type(tl.bfloat16)) + rope_cols, rope.to(tl.bfloat16))


_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _libdevice() -> bool:
    """CUDA's libm (the GPU), or tl's (Triton's interpreter, which runs on numpy and has no libdevice)."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def supports_index_keys(keys: torch.Tensor) -> bool:
    return (keys.is_cuda and keys.dim() == 2 and keys.shape[1] == INDEX_HEAD_DIM and keys.stride(1) == 1
            and keys.dtype in _FLOATS and keys.shape[0] > 0)


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 128] float → ([T, 128] float8_e4m3fn, [T] float32 power-of-two scales), as the eager reference."""
    num = keys.shape[0]
    q = torch.empty((num, INDEX_HEAD_DIM), dtype=torch.float8_e4m3fn, device=keys.device)
    scales = torch.empty(num, dtype=torch.float32, device=keys.device)
    _index_keys_kernel[(num,)](keys, keys.stride(0), q, scales, DIM=INDEX_HEAD_DIM, LIBDEVICE=_libdevice(),
                               num_warps=1)
    return q, scales


def supports_pack_rows(rows: torch.Tensor) -> bool:
    return (rows.is_cuda and rows.dim() == 2 and rows.shape[1] == NOPE_DIM + ROPE_DIM and rows.stride(1) == 1
            and rows.dtype in _FLOATS and rows.shape[0] > 0)


def pack_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, 576] float rows → [N, 656] uint8 FlashMLA FP8 rows, as `kernels.fp8_rows.pack_fp8_rows`."""
    num = rows.shape[0]
    out = torch.empty((num, FP8_ROW_BYTES), dtype=torch.uint8, device=rows.device)
    _pack_rows_kernel[(num,)](rows, rows.stride(0), out, TILES=NUM_TILES, TILE_=TILE, ROPE=ROPE_DIM,
                              ROW_BYTES=FP8_ROW_BYTES, SCALE_AT=SCALE_OFFSET, ROPE_AT=ROPE_OFFSET,
                              LIBDEVICE=_libdevice(), num_warps=4)
    return out


assert FP8_MAX == 448.0 and AMAX_FLOOR == 1e-4  # the constants the kernels spell out
