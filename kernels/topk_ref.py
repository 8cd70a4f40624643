"""Top-k of the indexer scores with per-row lengths and a defined tie rule: the PyTorch reference.

This is the rule every path of the engine applies (the CPU reference, the pure-torch GPU fallback and the Triton
kernel in kernels/topk_triton.py), so that HiSparse and dense select the same positions bit for bit on any device,
and so that the selection is a function of the scores alone (torch.topk leaves the order of equal scores to the
implementation).

Rule, for one row of scores s[0..L) with n = min(seq_len, L) visible positions:
- Scores are compared through `order_keys`: an int32 whose order is the float order, with −0.0 equal to +0.0
  and every NaN equal to every other NaN and above +inf (as torch.topk ranks NaN). −inf is an ordinary value.
- n <= k: the output is 0, 1, ..., n−1 followed by k − n entries of −1.
- n > k: the k visible positions with the largest (key, −position): a higher score wins, and among equal
  scores the lower position wins. They are returned in ascending position order (not best first: attention
  and swap-in do not need the ranking, and position order needs no sort on the GPU).
Positions >= n are never read and never selected (the scores there may be anything, even unwritten memory).
"""

from __future__ import annotations

import torch

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
_NAN_KEY = INT32_MAX


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores → int32 keys with the same order (−0.0 == +0.0; NaN = the largest key, all NaNs equal).

    Non-negative floats keep their bits (they already sort as integers); negative floats get their 31 magnitude
    bits flipped, so that a larger magnitude gives a smaller key."""
    if scores.dtype != torch.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    bits = scores.contiguous().view(torch.int32)
    keys = torch.where(bits < 0, bits ^ INT32_MAX, bits)
    keys = torch.where(bits == INT32_MIN, torch.zeros_like(keys), keys)  # −0.0 → the key of +0.0
    is_nan = (bits & INT32_MAX) > 0x7F800000
    return torch.where(is_nan, torch.full_like(keys, _NAN_KEY), keys)


def topk_positions_ref(scores: torch.Tensor, seq_lens: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [T, L] float32, seq_lens [T] (any int dtype, any device) → [T, top_k] int32 positions, ascending,
    −1 pads (rule: module docstring). A stable sort by key (descending) puts equal scores in position order, so
    its first top_k entries are exactly the rule's set."""
    if scores.dim() != 2:
        raise ValueError(f"scores must be [T, L], got {tuple(scores.shape)}")
    if top_k <= 0:
        raise ValueError(f"top_k must be positive, got {top_k}")
    num_rows, width = scores.shape
    device = scores.device
    lens = seq_lens.to(device=device, dtype=torch.int64).clamp(0, width)
    slots = torch.arange(top_k, device=device, dtype=torch.int64)
    if num_rows == 0:
        return torch.empty((0, top_k), dtype=torch.int32, device=device)
    # Invisible positions get a key below every int32 key (so they are taken last, in position order).
    keys = order_keys(scores).to(torch.int64)
    keys = keys.masked_fill(torch.arange(width, device=device) >= lens.unsqueeze(1), INT32_MIN - 1)
    if width < top_k:
        keys = torch.cat([keys, keys.new_full((num_rows, top_k - width), INT32_MIN - 1)], dim=1)
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :top_k]
    picked = order.sort(dim=1).values
    # Rows with n <= top_k: their n visible positions are the smallest picked ones, so slots 0..n−1 hold 0..n−1.
    return torch.where(slots.unsqueeze(0) < lens.unsqueeze(1), picked, -1).to(torch.int32)
