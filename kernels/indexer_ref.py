"""Lightning-indexer key packing and top-k scoring, PyTorch reference.

Keys are cached as 128 FP8 e4m3 values plus one fp32 power-of-two scale per token (132 B). The score of token
s for a query with heads h is  I(s) = scale_s · Σ_h w_h · ReLU(q_h · k_fp8_s)  (fp32 accumulation).
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
INDEX_HEAD_DIM = 128


def pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax/448 rounded up to a power of two (exact when multiplied on any hardware), amax floored at 1e-4."""
    scale = amax.float().clamp(min=1e-4) / FP8_MAX
    return torch.exp2(torch.ceil(torch.log2(scale)))


def quantize_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 128] float → ([T, 128] float8_e4m3fn, [T] float32 power-of-two scales)."""
    scale = pow2_scale(keys.abs().amax(dim=-1))
    q = (keys.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_index_keys(keys_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return keys_fp8.float() * scales.unsqueeze(-1)


def index_scores_ref(
    q: torch.Tensor, weights: torch.Tensor, keys_fp8: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """Scores of T queries over N keys: q [T, Hi, 128] f32, weights [T, Hi] f32 → [T, N] f32."""
    logits = torch.einsum("thd,nd->thn", q.float(), keys_fp8.float())
    return torch.einsum("thn,th->tn", torch.relu(logits), weights.float()) * scales.float().unsqueeze(0)


def indexer_topk_ref(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """Top-k positions per query over its own request's first `seq_lens[t]` tokens.

    q [T, Hi, 128], weights [T, Hi], keys_fp8 [N, 128] / scales [N] (the key cache), token_rows [T, L] int
    (cache row of each position of the query's request), seq_lens [T] (tokens visible to the query, itself
    included). Returns [T, top_k] int32: when seq_len <= top_k, positions 0..seq_len-1 ascending; otherwise
    the top_k highest-scoring positions, best first (torch.topk order); −1 pads.
    """
    num_q, max_len = token_rows.shape
    out = torch.full((num_q, top_k), -1, dtype=torch.int32, device=q.device)
    seq_lens_cpu = [int(x) for x in seq_lens.tolist()]
    ar = torch.arange(max(top_k, 1), device=q.device, dtype=torch.int32)
    for t, n in enumerate(seq_lens_cpu):
        if n <= top_k:
            out[t, :n] = ar[:n]
            continue
        rows = token_rows[t, :n].long()
        s = index_scores_ref(q[t : t + 1], weights[t : t + 1], keys_fp8[rows], scales[rows])[0]
        out[t] = torch.topk(s, top_k, sorted=True).indices.to(torch.int32)
    del max_len
    return out
