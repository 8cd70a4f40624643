"""FlashMLA's 656-byte FP8 MLA KV row: pack and unpack (PyTorch; runs anywhere).

Layout of one row (one token, one layer):
  bytes [0, 512)    512 e4m3 values of the latent c_kv, in 4 tiles of 128
  bytes [512, 528)  4 fp32 scales, one per tile, powers of two (dequantized value = fp8 * scale)
  bytes [528, 656)  64 bf16 values of the RoPE part k_pe, not quantized
Power-of-two scales make the dequantization exact in any precision, so every kernel that reads the row
(reference, Triton, FlashMLA) sees the same numbers.
"""

from __future__ import annotations

import torch

from kernels.indexer_ref import FP8_MAX, pow2_scale

FP8_ROW_BYTES = 656
BF16_ROW_BYTES = 1152
NOPE_DIM = 512
ROPE_DIM = 64
TILE = 128
NUM_TILES = NOPE_DIM // TILE
SCALE_OFFSET = NOPE_DIM
ROPE_OFFSET = NOPE_DIM + 4 * NUM_TILES


def pack_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, 576] float rows → [N, 656] uint8 FlashMLA FP8 rows (per-128 power-of-two scales)."""
    if rows.dim() != 2 or rows.shape[1] != NOPE_DIM + ROPE_DIM:
        raise ValueError(f"expected rows [N, 576], got {tuple(rows.shape)}")
    n = rows.shape[0]
    nope = rows[:, :NOPE_DIM].float().reshape(n, NUM_TILES, TILE)
    scales = pow2_scale(nope.abs().amax(dim=-1))  # [N, 4]
    q = (nope / scales.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    out = torch.empty((n, FP8_ROW_BYTES), dtype=torch.uint8, device=rows.device)
    out[:, :NOPE_DIM] = q.reshape(n, NOPE_DIM).view(torch.uint8)
    out[:, SCALE_OFFSET:ROPE_OFFSET] = scales.contiguous().view(torch.uint8).reshape(n, 4 * NUM_TILES)
    rope = rows[:, NOPE_DIM:].to(torch.bfloat16).contiguous()
    out[:, ROPE_OFFSET:] = rope.view(torch.uint8).reshape(n, 2 * ROPE_DIM)
    return out


def unpack_fp8_rows(packed: torch.Tensor) -> torch.Tensor:
    """[N, 656] uint8 FP8 rows → [N, 576] float32 (exact dequantization)."""
    if packed.dim() != 2 or packed.shape[1] != FP8_ROW_BYTES or packed.dtype != torch.uint8:
        raise ValueError(f"expected uint8 [N, 656], got {tuple(packed.shape)} {packed.dtype}")
    n = packed.shape[0]
    q = packed[:, :NOPE_DIM].contiguous().view(torch.float8_e4m3fn).float().reshape(n, NUM_TILES, TILE)
    scales = packed[:, SCALE_OFFSET:ROPE_OFFSET].contiguous().view(torch.float32).reshape(n, NUM_TILES)
    rope = packed[:, ROPE_OFFSET:].contiguous().view(torch.bfloat16).float()
    return torch.cat([(q * scales.unsqueeze(-1)).reshape(n, NOPE_DIM), rope], dim=1)


def rows_as_float(kv: torch.Tensor) -> torch.Tensor:
    """KV rows in either format as [N, 576] floats: FP8 rows are unpacked, float rows returned as they are."""
    if kv.dtype == torch.uint8:
        return unpack_fp8_rows(kv)
    return kv
