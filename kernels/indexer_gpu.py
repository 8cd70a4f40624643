"""Lightning-indexer top-k for a batch: the Triton kernels on CUDA, batched torch ops elsewhere.

Same semantics as kernels/indexer_ref.py (`indexer_topk_ref`): scores, then the selection rule of
kernels/topk_ref.py (ascending positions, equal scores won by the lower position, −1 pads; queries whose request
has <= top_k tokens get 0..n-1). The dispatcher uses `indexer_topk_batched` on CUDA; it runs
kernels/indexer_fast.py there (scores kernel + top-k kernel: no host sync, no materialized keys) and the
pure-torch version (`indexer_topk_torch`, the same rule through `topk_positions_ref`) on devices without Triton.
The GPU scores carry the kernel's rounding (kernels/indexer_fast.py), so near-ties can select differently from
the fp32 reference; every mode on one device calls the same code and selects the same positions. Triton is
imported lazily, so this module imports without it.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from kernels.topk_ref import topk_positions_ref

# Bound on the fp32 [queries, heads, positions] logits materialized at once (elements).
_MAX_LOGITS = 1 << 27


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def indexer_topk_batched(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
    tables_ready: bool = False,
) -> torch.Tensor:
    """q [T, Hi, 128], weights [T, Hi], keys_fp8 [N, 128], scales [N], token_rows [B, L] (cache row of each
    position of each request), token_req [T] (request of each query), seq_lens [T]
    → [T, top_k] int32 positions (ascending), −1 pads. Triton on CUDA, torch ops otherwise. tables_ready: see
    `kernels.indexer_fast.indexer_scores_fast` (timing only)."""
    args = (q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, top_k)
    if q.is_cuda and triton_available():
        from kernels.indexer_fast import indexer_topk_fast

        return indexer_topk_fast(*args, tables_ready=tables_ready)
    return indexer_topk_torch(*args)


def indexer_topk_torch(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_fp8: torch.Tensor,
    scales: torch.Tensor,
    token_rows: torch.Tensor,
    token_req: torch.Tensor,
    seq_lens: torch.Tensor,
    top_k: int,
) -> torch.Tensor:
    """q [T, Hi, 128], weights [T, Hi], keys_fp8 [N, 128], scales [N], token_rows [B, L] (cache row of each
    position of each request), token_req [T] (request of each query), seq_lens [T]
    → [T, top_k] int32 positions (ascending), −1 pads. Pure torch: gathers the keys as fp32 [t, L, 128]
    in chunks and syncs once with the host (max seq_len bounds the scored width)."""
    num_q = q.shape[0]
    max_len = token_rows.shape[1]
    device = q.device
    seq = seq_lens.to(device=device, dtype=torch.int64)
    ar = torch.arange(top_k, device=device, dtype=torch.int64)
    dense = torch.where(ar.unsqueeze(0) < seq.unsqueeze(1), ar.unsqueeze(0), -1).to(torch.int32)
    if num_q == 0 or max_len <= top_k:
        return dense  # every request fits: attention is dense over 0..n-1
    # Only the first max(seq_len) positions can be visible.
    max_len = min(max_len, max(top_k + 1, int(seq.max())))
    heads = q.shape[1]
    rows_per_chunk = max(1, _MAX_LOGITS // max(1, heads * max_len))
    picked = torch.empty((num_q, top_k), dtype=torch.int32, device=device)
    num_keys = keys_fp8.shape[0]
    for start in range(0, num_q, rows_per_chunk):
        end = min(num_q, start + rows_per_chunk)
        rows = token_rows[token_req[start:end].long()].long().clamp(0, num_keys - 1)  # [t, L]
        keys = keys_fp8[rows].float()  # [t, L, 128]
        logits = torch.bmm(q[start:end].float(), keys.transpose(1, 2))  # [t, Hi, L]
        scores = torch.bmm(weights[start:end].float().unsqueeze(1), torch.relu(logits)).squeeze(1)  # [t, L]
        scores = scores * scales.float()[rows]
        picked[start:end] = topk_positions_ref(scores, seq[start:end], top_k)
    return torch.where((seq <= top_k).unsqueeze(1), dense, picked)
