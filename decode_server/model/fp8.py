"""FP8 e4m3 weights with block-wise scales, as DeepSeek checkpoints store them.

Each FP8 `X.weight` [out, in] comes with `X.weight_scale_inv` float32 [ceil(out/bo), ceil(in/bi)] (block
128×128). Despite the name the scale is *multiplied*: W[i, j] = fp8[i, j] · scale_inv[i // bo, j // bi]. Edge
blocks may be ragged (out or in not a multiple of the block).

A tensor-parallel rank reads a piece of the weight whose edges need not fall on block edges: it dequantizes the
piece with the scale rows/columns the piece touches and the piece's origin in the full weight.
"""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0


def scale_shape(weight_shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    out_dim, in_dim = weight_shape
    return math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])


def _expand_blocks(
    scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int], lead: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Per-element scales of a [shape] piece that starts `lead` elements into the first block of scale_inv."""
    expanded = scale_inv.float().repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return expanded[lead[0] : lead[0] + shape[0], lead[1] : lead[1] + shape[1]]


def scale_window(start: int, stop: int, block: int) -> tuple[int, int]:
    """[first, last) block indices that elements [start, stop) of one dimension touch."""
    return start // block, math.ceil(stop / block)


def dequantize_block_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
    origin: tuple[int, int] = (0, 0),
) -> torch.Tensor:
    """FP8 [out, in] + block scales → float32 [out, in].

    `origin`: where this piece of a larger weight starts (row, col); `scale_inv` then holds only the blocks
    the piece touches (`scale_window` of each dimension), the whole scale tensor for a whole weight."""
    if weight.dim() != 2:
        raise ValueError(f"block FP8 weights are 2-D, got shape {tuple(weight.shape)}")
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    windows = [scale_window(origin[d], origin[d] + shape[d], block[d]) for d in range(2)]
    expected = (windows[0][1] - windows[0][0], windows[1][1] - windows[1][0])
    if tuple(scale_inv.shape) != expected:
        piece = f" at offset {origin}" if origin != (0, 0) else ""
        raise ValueError(
            f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expected} for weight {shape}"
            f"{piece} with {block[0]}x{block[1]} blocks"
        )
    lead = (origin[0] - windows[0][0] * block[0], origin[1] - windows[1][0] * block[1])
    return weight.float() * _expand_blocks(scale_inv, shape, block, lead)


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
