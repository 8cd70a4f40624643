"""Lightning indexer of DeepSeek Sparse Attention: per-token FP8 keys and per-query head weights.

Per new token:
  q = wq_b(c_q) → [Hi, 128] (c_q is the MLA query latent), k = LayerNorm(wk(x)) → [128];
  RoPE on the first `qk_rope_head_dim` (64) dims of both, half-split pairs (DeepSeek-V3.2) or interleaved pairs
  (GLM-5, `indexer_rope_interleave`); the rest pass through;
  both rotated by the normalized 128×128 Walsh–Hadamard matrix (see below);
  k packed as FP8 e4m3 + one fp32 power-of-two scale (`kernels.indexer_ref.quantize_index_keys`);
  w = weights_proj(x) · Hi^-0.5 · 128^-0.5 (all scale factors folded, float32).
The backend then scores  I(s) = scale_s · Σ_h w_h · ReLU(q_h · k_fp8_s)  and keeps the top `index_topk`.

Hadamard rotation — we apply it. H is orthogonal and symmetric (H·Hᵀ = I), so (Hq)·(Hk) = q·k and the exact
scores are unchanged; what changes is the FP8 rounding of the cached keys. DeepSeek's inference code (and
SGLang) rotate before quantizing, which spreads outlier channels over all 128 values so that one per-token
power-of-two scale wastes less range; the model's indexer was trained and deployed that way. transformers skips
both the rotation and FP8 (it scores in full precision), so for interoperability the choice only matters
through FP8 rounding, which the interop tests measure (exact agreement while every position is selected,
top-1 agreement rate beyond `index_topk`). q must be rotated with the same H so the dot products stay the same.
The rotation is computed by the fast Walsh–Hadamard transform (`kernels.indexer_ref.walsh_hadamard`: seven
stages of adds and subtracts in a fixed order), which the GPU kernels of the query's and the keys' chains repeat
bit for bit (`fused_ops.index_query` / `index_keys`, kernels/indexer_rotation_triton.py).
On CUDA q leaves here in e4m3 with a power of two per head folded into w (`fused_ops.index_query`: the form the
FP8 scores kernel reads, as in DeepSeek's code); elsewhere in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from decode_server.model import batch_invariant, fused_ops
from decode_server.model.batch_invariant import Linear
from decode_server.model.config import ModelConfig
from decode_server.model.layers import narrow_linear


def hadamard_matrix(dim: int) -> torch.Tensor:
    """Normalized Walsh–Hadamard matrix [dim, dim] (Sylvester construction), float32.

    Sylvester's construction exists for powers of two only (128 in every DSA checkpoint). For another
    `index_head_dim` the rotation is the identity: it never changes exact scores, only FP8 rounding. The model
    multiplies by it through the fast transform (`kernels.indexer_ref.walsh_hadamard`); the matrix is the
    definition the tests hold that transform to."""
    if dim < 1:
        raise ValueError(f"index_head_dim must be positive, got {dim}")
    if dim & (dim - 1):
        return torch.eye(dim, dtype=torch.float32)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / dim**0.5).to(torch.float32)


@dataclass
class IndexerOutput:
    q: torch.Tensor  # [T, Hi, D] float32 (rotated), or float8_e4m3fn with a power of two per head (CUDA)
    weights: torch.Tensor  # [T, Hi] float32, scale factors folded in (with q in e4m3: its inverse powers of two too)
    keys_fp8: torch.Tensor  # [T, D] float8_e4m3fn
    key_scales: torch.Tensor  # [T] float32 (powers of two)


class Indexer(nn.Module):
    """Parameters named as in the checkpoints: `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.rope_interleaved = bool(config.indexer_rope_interleave)
        self.weight_scale = config.index_weight_scale
        self.wq_b = Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        # Kept in float32 (bf16 in checkpoints, upcast like DeepSeek's inference code and transformers).
        self.weights_proj = Linear(config.hidden_size, self.n_heads, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_proj: torch.Tensor | None = None, q_proj: torch.Tensor | None = None) -> IndexerOutput:
        """x [T, hidden], q_latent [T, q_lora_rank]; cos/sin [T, rope_dim/2] float32. k_proj: wk(x) when the
        caller computed it (MLA's fused input projections), else computed here; q_proj likewise wq_b(q_latent)
        (MLA's fused query projections)."""
        num_tokens = x.shape[0]
        k = batch_invariant.layer_norm((self.wk(x) if k_proj is None else k_proj).float(), self.k_norm)
        keys_fp8, key_scales = fused_ops.index_keys(k, cos, sin, self.rope_dim, self.rope_interleaved)
        if batch_invariant.enabled():
            weights = batch_invariant.linear(x.float(), self.weights_proj.weight.float())
        else:
            weights = narrow_linear(x.float(), self.weights_proj.weight.float())
        q = (self.wq_b(q_latent) if q_proj is None else q_proj).view(num_tokens, self.n_heads, self.head_dim)
        q, weights = fused_ops.index_query(q, cos, sin, self.rope_dim, self.rope_interleaved, weights,
                                           self.weight_scale)
        return IndexerOutput(q=q, weights=weights, keys_fp8=keys_fp8, key_scales=key_scales)
