"""Small building blocks shared by the DSA model: RMSNorm and the SwiGLU MLP (dense layers, experts)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decode_server.model import batch_invariant
from decode_server.parallel.layers import column_linear, row_linear
from decode_server.parallel.state import ParallelState, resolve


class RMSNorm(nn.Module):
    """x / rms(x) · weight, normalized in float32 then cast back to the input dtype before the weight."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.enabled():
            return batch_invariant.on_row_tiles(self._normalize, x)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used for dense layers, experts and shared experts.

    With tensor parallelism the intermediate dimension is split: gate/up column-parallel, down row-parallel,
    whose partial sums are all-reduced here, or by the caller when `reduce` is False (the MoE reduces its
    routed and shared experts' partials at once)."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelState | None = None,
                 reduce: bool = True, what: str = "intermediate_size") -> None:
        super().__init__()
        parallel = resolve(parallel)
        self.gate_proj = column_linear(hidden_size, intermediate_size, False, parallel, what)
        self.up_proj = column_linear(hidden_size, intermediate_size, False, parallel, what)
        self.down_proj = row_linear(intermediate_size, hidden_size, False, parallel, reduce, what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
