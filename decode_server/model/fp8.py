"""FP8 e4m3 weights with block-wise scales, as DeepSeek checkpoints store them.

Each FP8 `X.weight` [out, in] comes with `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)] (block
128×128). Despite the name the scale is *multiplied*: W[i, j] = fp8[i, j] · scale_inv[i // bo, j // bi]. Edge
blocks may be ragged (out or in not a multiple of the block).
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    out_dim, in_dim = weight_shape
    return math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])


def _expand_blocks(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    expanded = scale_inv.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return expanded[: shape[0], : shape[1]]


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """FP8 [out, in] + block scales → float32 [out, in]."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 weights are 2-D, got shape {tuple(weight.shape)}")
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    expected = scale_shape(shape, block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for weight {shape} "
            f"with {block[0]}x{block[1]} blocks"
        )
    return weight.float() * _expand_blocks(scale_inv, shape, block)


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] → (float8_e4m3fn [out, in], float32 scale_inv [ceil(out/bo), ceil(in/bi)]).

    scale_inv = block amax / 448, so every block uses the full e4m3 range (used to write checkpoints)."""
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    rows, cols = scale_shape(shape, block)
    padded = torch.zeros(rows * block[0], cols * block[1], dtype=torch.float32, device=weight.device)
    padded[: shape[0], : shape[1]] = weight.float()
    blocks = padded.view(rows, block[0], cols, block[1])
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    quant = (weight.float() / _expand_blocks(scale_inv, shape, block)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return quant.to(torch.float8_e4m3fn), scale_inv
