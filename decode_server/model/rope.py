"""Rotary position embeddings: YaRN frequencies and the two pair layouts DeepSeek-V3.2 uses.

- MLA rotates *interleaved* pairs (x[2j], x[2j+1]) and keeps them in place (the cache row's k_pe is stored in
  that layout).
- The lightning indexer rotates *half-split* pairs (x[j], x[j + d/2]) on the first `qk_rope_head_dim` dims of
  its 128-dim heads (DeepSeek fixed the indexer to this layout on 2025-11-17).

Both share one frequency table. Angles are computed in float64 so that positions in the 100K range keep full
precision before the cos/sin are cast to the model's dtype.
"""

from __future__ import annotations

import math

import torch

from decode_server.model.config import RopeConfig


def _correction_dim(num_rotations: float, dim: int, base: float, original_max: int) -> float:
    """Dimension index whose wavelength completes `num_rotations` turns over the original context."""
    return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_ramp_bounds(rope: RopeConfig, dim: int) -> tuple[float, float]:
    """Index range [low, high] over which YaRN blends extrapolated into interpolated frequencies."""
    assert rope.original_max_position_embeddings is not None
    low = _correction_dim(rope.beta_fast, dim, rope.rope_theta, rope.original_max_position_embeddings)
    high = _correction_dim(rope.beta_slow, dim, rope.rope_theta, rope.original_max_position_embeddings)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def inverse_frequencies(rope: RopeConfig, dim: int) -> torch.Tensor:
    """[dim/2] float64 inverse frequencies theta^(-2i/dim), YaRN-blended with theta^(-2i/dim)/factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    extrapolated = 1.0 / (rope.rope_theta**exponents)
    if rope.rope_type != "yarn":
        return extrapolated
    interpolated = extrapolated / rope.factor
    low, high = yarn_ramp_bounds(rope, dim)
    if high == low:
        high = high + 0.001  # a zero-width ramp would divide by zero; this keeps the step shape
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    # ramp == 0: keep the original (high-frequency) band; ramp == 1: fully interpolated (low frequencies).
    return interpolated * ramp + extrapolated * (1.0 - ramp)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin [T, dim/2] for given positions (scaled by YaRN's cos/sin attention factor)."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.cos_sin_factor = rope.cos_sin_factor()
        self.register_buffer("inv_freq", inverse_frequencies(rope, dim), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq.to(positions.device)
        cos = (torch.cos(angles) * self.cos_sin_factor).to(dtype)
        sin = (torch.sin(angles) * self.cos_sin_factor).to(dtype)
        return cos, sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2j], x[2j+1]) by angle j. x [T, ..., d]; cos/sin [T, d/2] (broadcast over middle dims)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return out.flatten(-2)


def apply_rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[j], x[j + d/2]) by angle j. x [T, ..., d]; cos/sin [T, d/2]."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos, sin = cos.view(shape), sin.view(shape)
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
