"""Block-FP8 GEMM references (pure PyTorch, any device): the CPU path and the oracle of the GPU kernels.

DeepSeek's recipe: a weight W [N, K] is stored as float8 e4m3 with one float32 `weight_scale_inv` per 128×128
block (W[n, k] = q[n, k] · s[n // 128, k // 128]); an activation x [M, K] is quantized per token and per group of
128 channels at run time: s_x = max(amax(group), eps) / 448, q_x = RNE(x / s_x) (round to nearest even, |q_x| ≤
448), both in float32 with IEEE division. A block-FP8 GEMM then computes

    y[m, n] = Σ_g s_x[m, g] · s_w[n // 128, g] · Σ_{k ∈ g} q_x[m, k] · q_w[n, k]

with float32 accumulation. `fp8_linear_ref` computes exactly that sum in float32 (after rounding x as the kernels
do), so a kernel differs from it only by its accumulation order and its output rounding; with `quantize_input=False`
it is the plain dequantize-and-matmul reference (x unrounded), from which the kernels also differ by the
activation rounding (bounded in `activation_rounding_bound`).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
GROUP = 128  # activation group = weight block along K
ACT_EPS = 1e-10  # amax floor: an all-zero group gets a tiny positive scale instead of a division by zero


def quantize_activations_ref(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) → (q [M, K] float8_e4m3fn, scales [M, ceil(K / group)] float32).

    scale = max(amax of the group, ACT_EPS) / 448 and q = RNE(clamp(x / scale, ±448)), all in float32 — the same
    arithmetic as the Triton quantization kernel (kernels/fp8_gemm_triton.py), which matches it bit for bit."""
    if x.dim() != 2:
        raise ValueError(f"activations must be 2-D [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    groups = math.ceil(k / group) if k else 0
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    amax = padded.abs().amax(dim=-1)
    # A tensor divisor, not the Python float: PyTorch's CUDA division by a scalar multiplies by its reciprocal,
    # which rounds differently from the IEEE division the Triton kernel does (seen on an H100: 1-ulp scales).
    scales = torch.clamp(amax, min=ACT_EPS) / torch.full_like(amax, FP8_MAX)
    values = (padded / scales.unsqueeze(-1)).view(m, groups * group)[:, :k]
    return values.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def dequantize_activations_ref(q: torch.Tensor, scales: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """(q [M, K], scales [M, G]) → float32 [M, K]."""
    k = q.shape[1]
    return q.float() * scales.repeat_interleave(group, dim=1)[:, :k]


def dequantize_weight_ref(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """FP8 [..., N, K] + block scales [..., ceil(N/bn), ceil(K/bk)] → float32 [..., N, K] (ragged edges allowed)."""
    n, k = w.shape[-2:]
    expanded = scale_inv.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w.float() * expanded[..., :n, :k]


def _matmul_exact(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of float32 operands. On a GPU: summed in float64 and rounded once to float32, a reference whose own
    error is negligible next to the kernels' (a float32 GEMM there may run on TF32 tensor cores, 10-bit products,
    whatever `allow_tf32` says under some torch settings; seen on an H100 as errors 3.5x the kernels' tolerance).
    On the CPU, where this is also the serving path of `--quantization fp8`, a float32 GEMM is float32 arithmetic:
    kept in float32, so it is the same arithmetic as the dequantized model's `F.linear` (tests hold it bit for bit)."""
    if a.is_cuda:
        return (a.double() @ b.double()).float()
    return a @ b


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                   *, quantize_input: bool = True) -> torch.Tensor:
    """x [M, K] @ dequant(W)ᵀ in float32 → [M, N] float32. `quantize_input`: round x per token and 128-channel
    group first, as the GPU kernels do (so they differ from this only by summation order and output rounding)."""
    if block[1] != GROUP and quantize_input:
        raise ValueError(f"activation groups are {GROUP} channels: the weight's K block must be {GROUP}, got {block}")
    xf = dequantize_activations_ref(*quantize_activations_ref(x)) if quantize_input else x.float()
    return _matmul_exact(xf, dequantize_weight_ref(w, scale_inv, block).t())


def fp8_grouped_ref(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, end_offsets: torch.Tensor,
                    block: tuple[int, int] = (128, 128), *, quantize_input: bool = True) -> torch.Tensor:
    """Rows of x [M, K] sorted by expert; expert e owns rows [end_offsets[e-1], end_offsets[e]) and multiplies them
    by its weight w[e] [N, K] (block scales scale_inv[e]). → float32 [M, N]; rows past the last offset are 0."""
    xf = dequantize_activations_ref(*quantize_activations_ref(x)) if quantize_input else x.float()
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, end in enumerate(end_offsets.tolist()):
        if end > start:
            out[start:end] = _matmul_exact(xf[start:end], dequantize_weight_ref(w[e], scale_inv[e], block).t())
        start = end
    return out


def fp8_bmm_ref(a: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                *, quantize_input: bool = True) -> torch.Tensor:
    """Batched: a [G, M, K] (any strides) @ dequant(w[g] [N, K])ᵀ per group g → float32 [G, M, N] (the oracle of
    kernels/fp8_bmm_triton.py: each group is `fp8_linear_ref` of its own rows and weight)."""
    if a.dim() != 3 or w.dim() != 3 or a.shape[0] != w.shape[0]:
        raise ValueError(f"batched operands are a [G, M, K] and w [G, N, K], got {tuple(a.shape)}, {tuple(w.shape)}")
    out = torch.empty(a.shape[0], a.shape[1], w.shape[1], dtype=torch.float32, device=a.device)
    for g in range(a.shape[0]):
        out[g] = fp8_linear_ref(a[g], w[g], scale_inv[g], block, quantize_input=quantize_input)
    return out


def activation_rounding_bound(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor,
                              block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Worst-case |y_fp8 − y_exact| [M, N] caused by rounding x to FP8 (the weights are exact in both).

    An e4m3 value of the group's scaled range [−448, 448] has 3 mantissa bits: a normal one (|v| ≥ 2⁻⁶) is within
    2⁻⁴ of its own magnitude after rounding, a subnormal one within 2⁻¹⁰ (half the 2⁻⁹ step) absolutely. In x's
    units, |x_q − x| ≤ max(2⁻⁴·|x|, 2⁻¹⁰·s_g) ≤ 2⁻⁴·|x| + 2⁻¹⁰·s_g per element, hence
        |Δy[m, n]| ≤ 2⁻⁴ · Σ_k |x[m, k]|·|W[n, k]| + 2⁻¹⁰ · Σ_g s_g[m] · Σ_{k∈g} |W[n, k]|."""
    _, scales = quantize_activations_ref(x)
    wabs = dequantize_weight_ref(w, scale_inv, block).abs()
    k = x.shape[1]
    groups = scales.shape[1]
    group_sums = torch.nn.functional.pad(wabs, (0, groups * GROUP - k)).view(w.shape[0], groups, GROUP).sum(-1)
    return 2.0**-4 * (x.float().abs() @ wabs.t()) + 2.0**-10 * (scales @ group_sums.t())
