"""SwiGLU's `silu(gate) * up` as one Triton kernel for CUDA tensors.

Why: eager it is two launches (`F.silu`, then the product), and every MLP of a step runs it once — the dense
layers', the shared experts' and the routed experts' (`MoE.expert_mlps`, both weight formats). At decode batch
sizes a step is bound by its launches as much as by its bytes (docs/model.md "Computation"); this is one launch
that also skips writing and re-reading the silu intermediate.

Numerics: eager's bits. PyTorch's CUDA silu (aten/src/ATen/native/cuda/ActivationSiluKernel.cu) computes, per
element, in the op-math type (float32 for bf16 / fp16 / fp32) `x / (1 + ::exp(-x))` and rounds to the input
dtype; nvcc builds it without fast math, so `::exp` is CUDA's accurate `expf` (libdevice's `__nv_expf`, without
flushing subnormals) and the divide is IEEE round-to-nearest. The product is then a separate binary kernel: both
operands widened to float32, multiplied, rounded to the dtype. Here: libdevice `expf` with Triton's
`__CUDA_FTZ` reflection off (`enable_reflect_ftz=False`, nvcc's default), `div_rn`, the round to the input dtype
after silu, the float32 product, the round again. (LLVM turns the float32 product of two widened bf16 / fp16
values into a bf16 / fp16 multiply, `mul.rn.bf16x2`: the same bits, since two 8-bit (11-bit) significands
multiply exactly in float32's 24, so either way one rounding to the dtype follows — for bf16 products above
float32's subnormal range, 2^-126.) Nothing here can be contracted to an FMA, and FMA contraction is off anyway.
tests/kernels/triton_cpu_checks.py `compile-swiglu` checks these instructions in the sm_90 PTX; the GPU test
(tests/model/test_fused_ops_gpu.py) holds the bits to eager's. Triton's interpreter has no libdevice: there
`exp` is NumPy's (`LIBDEVICE` off; the CPU check allows a few ulps from eager). Elementwise, so batch
invariant; the grid depends only on the shapes (CUDA-graph capturable, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from kernels.fp8_quant_triton import _libdevice

BLOCK = 1024  # columns per program
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _silu_mul_kernel(gate_ptr, gate_stride, up_ptr, up_stride, out_ptr, n, BLOCK_: tl.constexpr,
                     LIBDEVICE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_ + tl.arange(0, BLOCK_)
    mask = cols < n
    gate = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0)
    x = gate.to(tl.float32)
    e = libdevice.exp(-x) if LIBDEVICE else tl.exp(-x)  # CUDA's expf; the interpreter has only numpy's
    silu = tl.math.div_rn(x, 1.0 + e).to(gate.dtype)  # F.silu's result, in the input dtype
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * n + cols, out, mask=mask)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Same shape, dtype and CUDA device; a float dtype; the last dim contiguous; not empty."""
    return (gate.is_cuda and up.device == gate.device and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.dtype in _FLOATS and gate.dim() >= 1 and gate.numel() > 0 and gate.stride(-1) == 1
            and up.stride(-1) == 1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, n]: itself if 2-D, else its leading dims flattened (a view where the strides allow)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one launch, with eager's bits (module docstring): a new contiguous tensor of
    gate's shape and dtype. Rows may be strided (e.g. column slices of the stacked gate/up GEMM's output)."""
    n = gate.shape[-1]
    gate2, up2 = _rows(gate), _rows(up)
    if gate2.stride(-1) != 1 or up2.stride(-1) != 1:  # reshape copied a view it could not flatten
        gate2, up2 = gate2.contiguous(), up2.contiguous()
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows = gate2.shape[0]
    _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](
        gate2, gate2.stride(0), up2, up2.stride(0), out, n, BLOCK_=BLOCK, LIBDEVICE=_libdevice(), num_warps=4,
        enable_fp_fusion=False, enable_reflect_ftz=False,
    )
    return out
