"""Lightning-indexer key packing and top-k scoring, PyTorch reference.

Keys are cached as 128 FP8 e4m3 values plus one fp32 power-of-two scale per token (132 B). The score of token
s for a query with heads h is  I(s) = scale_s · Σ_h w_h · ReLU(q_h · k_fp8_s)  (fp32 accumulation).
"""

from __future__ import annotations

import torch

from kernels.topk_ref import topk_positions_ref

FP8_MAX = 448.0
INDEX_HEAD_DIM = 128


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] float32 times the normalized n×n Sylvester Hadamard matrix (n a power of two; any other n: x
    unchanged), by the fast transform: log2(n) stages pairing x[i] with x[i + h] (h = 1, 2, 4, …) into their sum
    and difference, then one multiply by float32(n^-0.5). The same product as `x @ hadamard_matrix(n)` to float32
    rounding, in a fixed order of operations that the GPU kernels repeat bit for bit
    (kernels/indexer_rotation_triton.py); row-local, so batch invariant."""
    n = x.shape[-1]
    if n & (n - 1):
        return x
    shape = x.shape
    stride = 1
    while stride < n:
        pairs = x.reshape(-1, n // (2 * stride), 2, stride)
        first, second = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((first + second, first - second), dim=2).reshape(shape)
        stride *= 2
    return x * n**-0.5


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
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    query_chunk: int = 256,
) -> torch.Tensor:
    """Top-k positions per query over its own request's first `seq_lens[t]` tokens.

    q [T, Hi, 128] and weights [T, Hi] (float32), keys_fp8 [N, 128] / scales [N] (the key cache),
    token_rows [B, L] int (cache row of each position of each request), token_req [T] (request index 0..B-1 of
    each query), seq_lens [T] (tokens visible to each query, itself included).
    Returns [T, top_k] int32: when seq_len <= top_k, positions 0..seq_len-1 ascending, −1 pads; otherwise the
    top_k highest-scoring positions in ascending order, equal scores won by the lower position (the selection
    rule of kernels/topk_ref.py, shared by every path so that the choice never depends on the device).
    Queries are processed per request in chunks of `query_chunk`, so memory is O(query_chunk · L), never T · L.
    """
    num_q = q.shape[0]
    out = torch.full((num_q, top_k), -1, dtype=torch.int32, device=q.device)
    if num_q == 0:
        return out
    lens = seq_lens.to(torch.int64)
    short = lens <= top_k
    if bool(short.any()):
        ar = torch.arange(top_k, device=q.device, dtype=torch.int64)
        fill = torch.where(ar.unsqueeze(0) < lens.unsqueeze(1), ar.unsqueeze(0), torch.full_like(ar, -1))
        out[short] = fill[short].to(torch.int32)
    long_idx = torch.nonzero(~short).flatten()
    if long_idx.numel() == 0:
        return out
    reqs = token_req[long_idx]
    for b in torch.unique(reqs).tolist():
        queries = long_idx[reqs == b]
        n_max = int(lens[queries].max())
        rows = token_rows[b, :n_max].long()
        keys, key_scales = keys_fp8[rows], scales[rows]
        for start in range(0, queries.numel(), query_chunk):
            qi = queries[start : start + query_chunk]
            s = index_scores_ref(q[qi], weights[qi], keys, key_scales)
            out[qi] = topk_positions_ref(s, lens[qi], top_k)
    return out
