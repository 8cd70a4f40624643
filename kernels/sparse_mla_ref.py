"""Sparse MLA decode, PyTorch reference (the oracle for the Triton kernel; the engine runs it on CPU).

Semantics shared by every implementation:
  q [B, H, 576], kv rows [N, 576] (any float dtype; FP8 656 B rows are unpacked first), indices [B, K] int32
  with −1 = skip → out [B, H, 512] (q's dtype), lse [B, H] float32 (natural log).
  576 = kv_lora_rank 512 + rope 64 (DeepSeek-V3.2, GLM-5); this reference takes any row width D and value
  width `d_v` (= kv_lora_rank: values are the first d_v entries of a row), the GPU kernels only 576 / 512.
  A row whose indices are all −1 gives out = 0 and lse = +inf.
The result depends only on the selected rows and their order, never on which slots they sit in: this is
what makes HiSparse (rows in a small device buffer) bit-identical to dense (rows in the full cache).
"""

from __future__ import annotations

import torch

D_QK = 576
D_V = 512


def sparse_mla_decode_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    d_v: int = D_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query row over the KV rows it selects; computed in float32."""
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        raise ValueError("expected q [B, H, D], kv [N, D], indices [B, K]")
    if q.shape[0] != indices.shape[0] or q.shape[-1] != kv.shape[-1]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, kv {tuple(kv.shape)}, indices {tuple(indices.shape)}")
    valid = indices >= 0  # [B, K]
    safe = torch.where(valid, indices, torch.zeros_like(indices)).long()
    rows = kv[safe].float()  # [B, K, D]
    # Unselected rows may hold anything (NaN-poisoned in tests): zero them so 0 * NaN never appears.
    rows = torch.where(valid.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    scores = torch.einsum("bhd,bkd->bhk", q.float(), rows) * softmax_scale
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf where all invalid
    any_valid = valid.any(dim=-1, keepdim=True)  # [B, 1]
    safe_lse = torch.where(any_valid, lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))  # exp(-inf) = 0 for skipped entries
    out = torch.einsum("bhk,bkd->bhd", probs, rows[..., :d_v])
    lse = torch.where(any_valid, lse, torch.full_like(lse, float("inf")))
    return out.to(q.dtype), lse
