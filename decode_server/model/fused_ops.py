"""The model's elementwise steps — RMSNorm, the residual add before a norm, rotary embeddings, the FP8
quantization of FP8 KV rows, the indexer's query and key chains (rotary, Hadamard rotation, FP8), SwiGLU's
silu(gate) · up — as one Triton kernel each on CUDA (kernels/norm_rope_triton.py, kernels/fp8_quant_triton.py,
kernels/indexer_rotation_triton.py, kernels/swiglu_triton.py), eager PyTorch elsewhere. The MoE router's
selection follows the same switch (`MoEGate`, kernels/moe_route_triton.py).

Why a dispatcher: eager runs each of these as several small kernels (8-9 for a norm or a rotary, 2 for SwiGLU),
and at decode batch sizes a step is bound by how many kernels it launches as much as by the bytes it reads
(docs/model.md "Computation"). The eager versions here are the references and the CPU path. The rotary,
quantization and SwiGLU kernels give eager's bits; the norm kernel differs from eager only in its sum's order
(kernels/norm_rope_triton.py), and all are row-local, so batch invariant.

`set_enabled(False)` makes every call eager, the router's too (benchmarks compare the two in one process; tests
use it as the oracle); `set_router_enabled(False)` makes only the router eager (its own A/B)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from decode_server.model import batch_invariant
from decode_server.model.rope import apply_rope_half_split, apply_rope_interleaved
from kernels.fp8_rows import pack_fp8_rows as pack_fp8_rows_eager
from kernels.indexer_ref import quantize_index_keys as quantize_index_keys_eager
from kernels.indexer_ref import walsh_hadamard

_enabled = True
_router_enabled = True


def set_enabled(flag: bool) -> None:
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    return _enabled


def set_router_enabled(flag: bool) -> None:
    """The MoE router's kernel alone on or off (the other fused ops follow `set_enabled` only)."""
    global _router_enabled
    _router_enabled = bool(flag)


def router_enabled() -> bool:
    """Whether `MoEGate` may use its one-kernel router: both switches on."""
    return _enabled and _router_enabled


def _triton():
    """kernels.norm_rope_triton, imported on first CUDA use (it imports triton)."""
    from kernels import norm_rope_triton

    return norm_rope_triton


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) · weight: normalized in float32, cast back to x's dtype before the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None,
             quantize: bool = False) -> torch.Tensor:
    """RMSNorm over the last dim; into `out` (a [rows, n] view, e.g. columns of a cache row) if given.
    `quantize` (a hint: the next projection is a block-FP8 GEMM that reads quantized activations): where the one
    kernel runs, it also writes the result's FP8 form for that GEMM (kernels/norm_rope_triton.py); the result's
    values are the same either way."""
    if _enabled and x.is_cuda and _triton().supports_norm(x, weight) and (out is None or out.stride(-1) == 1):
        quantize = quantize and out is None and x.dim() == 2 and _triton().supports_quantized_output(x)
        return _triton().rms_norm(x, weight, eps, out=out, quantize=quantize)
    if batch_invariant.enabled():
        y = batch_invariant.on_row_tiles(lambda rows: rms_norm_eager(rows, weight, eps), x)
    else:
        y = rms_norm_eager(x, weight, eps)
    if out is None:
        return y
    out.copy_(y)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): a residual add and the norm after it, in one kernel on CUDA (`quantize`:
    as in `rms_norm`)."""
    if (_enabled and x.is_cuda and delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(-1) == 1
            and _triton().supports_norm(x, weight)):
        quantize = quantize and x.dim() == 2 and _triton().supports_quantized_output(x)
        return _triton().add_rms_norm(x, delta, weight, eps, quantize=quantize)
    summed = x + delta
    return summed, rms_norm(summed, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, d] or [T, H, d] rotated by cos/sin [T, d/2]; pairs (2j, 2j+1) if `interleaved`, else (j, j + d/2).
    Into `out` if given (same shape; x itself, or a slice of a larger tensor)."""
    if _enabled and x.is_cuda and _triton().supports_rope(x, cos, sin, out):
        return _triton().rope(x, cos, sin, interleaved, out=out)
    y = (apply_rope_interleaved if interleaved else apply_rope_half_split)(x, cos, sin)
    if out is None:
        return y
    out.copy_(y)
    return out


def _quant():
    """kernels.fp8_quant_triton, imported on first CUDA use (it imports triton)."""
    from kernels import fp8_quant_triton

    return fp8_quant_triton


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 128] float → (e4m3 keys, [T] float32 power-of-two scales): one kernel on CUDA, eager's bits."""
    if _enabled and keys.is_cuda and _quant().supports_index_keys(keys):
        return _quant().quantize_index_keys(keys)
    return quantize_index_keys_eager(keys)


def _indexer_fast():
    """kernels.indexer_fast, imported on first CUDA use (it imports triton)."""
    from kernels import indexer_fast

    return indexer_fast


def _rotation():
    """kernels.indexer_rotation_triton, imported on first CUDA use (it imports triton)."""
    from kernels import indexer_rotation_triton

    return indexer_rotation_triton


def rotate_index_heads(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
                       interleaved: bool) -> torch.Tensor:
    """The indexer's rotations, eager: x [T, H, d] or [T, d] in float32, the rotary embedding on its first
    rope_dim dims (pairs (2j, 2j+1) if `interleaved`, else (j, j + rope_dim/2)), then the normalized
    Walsh–Hadamard rotation of the d dims (`kernels.indexer_ref.walsh_hadamard`). A new tensor."""
    x = x.float()
    rotary = (apply_rope_interleaved if interleaved else apply_rope_half_split)(x[..., :rope_dim], cos, sin)
    return walsh_hadamard(torch.cat((rotary, x[..., rope_dim:]), dim=-1))


def index_query(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int, interleaved: bool,
                weights: torch.Tensor, weight_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's query from wq_b's output q [T, H, 128] and its head weights from weights_proj's [T, H]
    (float32), in the form the scores kernel reads: q rotated (`rotate_index_heads`), the weights · weight_scale.

    On CUDA, where the scores kernel runs its FP8 dot (kernels/indexer_fast.py, the default), q leaves in e4m3
    with a power of two per head folded into the weights — the form DeepSeek-V3.2's own indexer hands its FP8
    kernel — so the kernel's programs stop loading the fp32 query and quantizing it again (docs/kernels.md "The
    query in e4m3"); the scores are those of the float query, bit for bit. The whole chain (cast, rotary,
    rotation, quantization) is one kernel there (kernels/indexer_rotation_triton.py), with eager's bits.
    Elsewhere (and eager): float32 q. Every consumer takes either form (the reference scores `q.float()`)."""
    e4m3 = _enabled and q.is_cuda and _indexer_fast().takes_e4m3_query()
    if _enabled and q.is_cuda and _rotation().supports(q, cos, sin, rope_dim):
        return _rotation().index_query(q, cos, sin, interleaved, weights, weight_scale, quantize=e4m3)
    q = rotate_index_heads(q, cos, sin, rope_dim, interleaved)
    if e4m3:
        return _indexer_fast().quantize_query(q, weights, weight_scale)
    return q, weights * weight_scale


def index_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int,
               interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's cached keys from the normalized wk output k [T, 128]: rotated (`rotate_index_heads`) and
    packed as e4m3 + a power-of-two scale per token (`quantize_index_keys`); one kernel on CUDA, eager's bits."""
    if _enabled and k.is_cuda and _rotation().supports(k, cos, sin, rope_dim):
        return _rotation().index_keys(k, cos, sin, interleaved)
    return quantize_index_keys(rotate_index_heads(k, cos, sin, rope_dim, interleaved))


def pack_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """[N, 576] float rows → [N, 656] uint8 FP8 KV rows: one kernel on CUDA, eager's bits."""
    if _enabled and rows.is_cuda and _quant().supports_pack_rows(rows):
        return _quant().pack_fp8_rows(rows)
    return pack_fp8_rows_eager(rows)


def _swiglu():
    """kernels.swiglu_triton, imported on first CUDA use (it imports triton)."""
    from kernels import swiglu_triton

    return swiglu_triton


def silu_mul_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation, eager: two kernels (silu rounded to the dtype, then the product)."""
    return F.silu(gate) * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up (same shapes and dtype): one kernel on CUDA with eager's bits, saving a launch per MLP."""
    if _enabled and gate.is_cuda and _swiglu().supports(gate, up):
        return _swiglu().silu_mul(gate, up)
    return silu_mul_eager(gate, up)
