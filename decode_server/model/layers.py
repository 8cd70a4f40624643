"""Small building blocks shared by the DSA model: RMSNorm, the SwiGLU MLP (dense layers, experts) and the narrow
float32 projection of the MoE router and the indexer's head weights (`narrow_linear`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decode_server.model import fused_ops
from decode_server.model.fused_linear import FusedLinear, worth_stacking
from decode_server.parallel.layers import column_linear, row_linear
from decode_server.parallel.state import ParallelState, resolve

# Split-K for narrow float32 projections on CUDA (`narrow_linear`).
NARROW_SPLIT_CHUNK = 256
NARROW_MIN_ROWS = 8  # below: F.linear measured as fast or faster (H200, benchmarks/bench_narrow_linear.py)
NARROW_MAX_ROWS = 512
NARROW_MAX_OUT = 256


def narrow_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ weight [N, K]ᵀ in x's dtype, for the narrow float32 projections every decode step runs on the
    hidden state: the MoE router (N = its experts) and the indexer's head weights (N = 64), K = hidden size.

    Why not F.linear: with TF32 off, cuBLAS runs a float32 GEMM of a few dozen rows and N ≤ 256 in a few thread
    blocks that walk all of K (10-21 µs a call at T 16, K 7168, on an H100 and an H200: more than the ~2 MB of
    weights need). Here K is cut into chunks of NARROW_SPLIT_CHUNK: one batched GEMM (a
    block per chunk, the weight read in place through strides) and a sum over the chunks in order, all float32.
    The result depends only on the inputs and T (deterministic; both HiSparse and dense run it). Measured on an
    H100 and an H200 (docs/benchmarks.md): 1.3-1.5x faster at 16 rows, 0.97-1.35x at 64-256; below 8
    rows (cuBLAS's GEMV and small kernels win), on CPU, for wide outputs, long prefills and a K that the chunk does
    not divide, F.linear runs."""
    rows, k = x.shape
    n = weight.shape[0]
    if (not x.is_cuda or rows < NARROW_MIN_ROWS or rows > NARROW_MAX_ROWS or n > NARROW_MAX_OUT
            or k % NARROW_SPLIT_CHUNK or k == NARROW_SPLIT_CHUNK):
        return F.linear(x, weight)
    chunks = k // NARROW_SPLIT_CHUNK
    a = x.reshape(rows, chunks, NARROW_SPLIT_CHUNK).transpose(0, 1)  # [chunks, T, chunk]
    b = weight.reshape(n, chunks, NARROW_SPLIT_CHUNK).permute(1, 2, 0)  # [chunks, chunk, N], column-major views
    return torch.bmm(a, b).sum(0)


class RMSNorm(nn.Module):
    """x / rms(x) · weight, normalized in float32 then cast back to the input dtype before the weight (one kernel
    on CUDA: decode_server/model/fused_ops.py)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, quantize: bool = False) -> torch.Tensor:
        """`quantize`: the caller's next projection reads block-FP8 activations (fused_ops.rms_norm)."""
        return fused_ops.rms_norm(x, self.weight, self.eps, out=out, quantize=quantize)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor,
                    quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): the residual add before this norm, fused with it on CUDA."""
        return fused_ops.add_rms_norm(x, delta, self.weight, self.eps, quantize=quantize)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). Used for dense layers, experts and shared experts.

    With tensor parallelism the intermediate dimension is split: gate/up column-parallel, down row-parallel,
    whose partial sums are all-reduced here, or by the caller when `reduce` is False (the MoE reduces its
    routed and shared experts' partials at once).

    gate and up read the same x, so a dense or shared-expert MLP runs them as one GEMM over one stacked weight
    (`fuse_gate_up`, decode_server/model/fused_linear.py: the parameters become views of [gate ; up]). Routed
    experts (`stack_gate_up` False) do not: their weights are views of the MoE's expert stacks, where gate and up
    share one [E, 2I, H] stack instead (`MoE.gate_up_stack`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, parallel: ParallelState | None = None,
                 reduce: bool = True, what: str = "intermediate_size", stack_gate_up: bool = True) -> None:
        super().__init__()
        parallel = resolve(parallel)
        self.gate_proj = column_linear(hidden_size, intermediate_size, False, parallel, what)
        self.up_proj = column_linear(hidden_size, intermediate_size, False, parallel, what)
        self.down_proj = row_linear(intermediate_size, hidden_size, False, parallel, reduce, what)
        self.stack_gate_up = stack_gate_up
        self.fused_gate_up: FusedLinear | None = None

    @torch.no_grad()
    def fuse_gate_up(self, copy: bool = True) -> None:
        """Give gate and up one stacked weight (copy False: at construction, before loading; True: restack the
        current values unless they already are stacked). A no-op for routed experts and for projections that
        cannot share a stack (fused_linear.can_fuse)."""
        if not self.stack_gate_up or (self.fused_gate_up is not None and self.fused_gate_up.current()):
            return
        pair = [self.gate_proj, self.up_proj]
        self.fused_gate_up = FusedLinear(pair, copy) if worth_stacking(pair) else None

    def fp8_input_shape(self) -> tuple[int, int] | None:
        """(N, K) of the block-FP8 GEMM that reads this MLP's input (gate and up stacked), or None (bf16 weights,
        or gate and up apart: two GEMMs would share the quantized input only by chance of their choices)."""
        fused = self.fused_gate_up
        if fused is None or fused.stacked.get("weight_scale_inv") is None:
            return None
        return tuple(fused.stacked["weight"].shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if fused is not None and not fused.current():  # a parameter was replaced since (device move, reload)
            self.fuse_gate_up(copy=True)
            fused = self.fused_gate_up
        gate, up = fused(x) if fused is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(fused_ops.silu_mul(gate, up))
