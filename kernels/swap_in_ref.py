"""HiSparse swap-in, PyTorch reference (the CPU path of the engine and the oracle of the CUDA kernel).

For one layer and a batch, map each request's top-k token positions to device slots, loading the misses
from the host pool into least-recently-used device slots. The layout is docs/architecture.md "HiSparse
memory layout"; in short, for request row r with `seq_len` tokens (the current one included):

- fast path, seq_len <= D: token t sits at LRU position t, slot `buffer_slots[r, t]`. Nothing is read or
  written besides the output (the coordinator keeps `buffer_tokens[r] = arange(D)` for such requests).
- long path:
  - ring hit: t >= D and t >= seq_len - R  ->  slot `buffer_slots[r, D + t % R]`;
  - table hit: `buffer_tokens[r, j] == t`  ->  slot `buffer_slots[r, j]`;
  - miss: the m-th miss (top-k order) takes the m-th least recently used LRU position whose token is not
    selected this step; `buffer_tokens` records t and the host row `host_rows[r, t]` is copied into the
    position's slot of the device pool;
  - new LRU order = [evictable positions left unused, old order] + [just loaded, top-k order]
    + [hit positions, old order].
- Counters (optional [2] int64): hits (fast path, ring and table hits) and misses, accumulated in place.

Valid top-k entries of a request are distinct positions < seq_len (the indexer guarantees it); −1 pads and
stays −1 in the output.
"""

from __future__ import annotations

import torch


def check_swap_in_args(
    top_k_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    req_rows: torch.Tensor,
    buffer_slots: torch.Tensor,
    buffer_tokens: torch.Tensor,
    lru_order: torch.Tensor,
    host_rows: torch.Tensor,
    host_pool: torch.Tensor,
    device_pool: torch.Tensor,
    num_recent: int,
    counters: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate shapes and dtypes shared by every swap-in implementation; returns (B, K, D)."""
    if top_k_tokens.dim() != 2 or top_k_tokens.dtype != torch.int32:
        raise ValueError(f"top_k_tokens must be [B, K] int32, got {tuple(top_k_tokens.shape)} {top_k_tokens.dtype}")
    batch, top_k = top_k_tokens.shape
    if seq_lens.shape != (batch,) or req_rows.shape != (batch,):
        raise ValueError(f"seq_lens and req_rows must be [{batch}], got {tuple(seq_lens.shape)}, {tuple(req_rows.shape)}")
    if buffer_tokens.dim() != 2 or lru_order.shape != buffer_tokens.shape:
        raise ValueError("buffer_tokens and lru_order must both be [max_reqs, D] (one layer)")
    for name, t in (("buffer_slots", buffer_slots), ("buffer_tokens", buffer_tokens), ("lru_order", lru_order),
                    ("host_rows", host_rows)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {t.dtype}")
    buffer_size = buffer_tokens.shape[1]
    if num_recent < 1:
        raise ValueError(f"num_recent must be >= 1 (the current token lives in the recent ring), got {num_recent}")
    if buffer_slots.dim() != 2 or buffer_slots.shape[1] != buffer_size + num_recent:
        raise ValueError(
            f"buffer_slots must be [max_reqs, D + R] = [*, {buffer_size + num_recent}], got {tuple(buffer_slots.shape)}"
        )
    if buffer_size < top_k:
        raise ValueError(
            f"device buffer size D={buffer_size} must be >= top_k K={top_k}: each miss needs an LRU slot "
            "that no selected token occupies"
        )
    if host_pool.dim() != 2 or device_pool.dim() != 2 or host_pool.shape[1] != device_pool.shape[1]:
        raise ValueError(
            f"host_pool and device_pool must be [N, row_bytes] with equal row_bytes, got "
            f"{tuple(host_pool.shape)} and {tuple(device_pool.shape)}"
        )
    if host_pool.dtype != torch.uint8 or device_pool.dtype != torch.uint8:
        raise ValueError("host_pool and device_pool must be uint8 row tensors")
    if counters is not None and (counters.shape != (2,) or counters.dtype != torch.int64):
        raise ValueError("counters must be a [2] int64 tensor (hits, misses) or None")
    return batch, top_k, buffer_size


def swap_in_ref(
    top_k_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    req_rows: torch.Tensor,
    buffer_slots: torch.Tensor,
    buffer_tokens: torch.Tensor,
    lru_order: torch.Tensor,
    host_rows: torch.Tensor,
    host_pool: torch.Tensor,
    device_pool: torch.Tensor,
    num_recent: int,
    counters: torch.Tensor | None = None,
) -> torch.Tensor:
    """Map top-k positions [B, K] to device slots [B, K] int32 (−1 stays −1); see the module docstring."""
    batch, top_k, buffer_size = check_swap_in_args(
        top_k_tokens, seq_lens, req_rows, buffer_slots, buffer_tokens, lru_order, host_rows, host_pool,
        device_pool, num_recent, counters,
    )
    device = top_k_tokens.device
    out = torch.full((batch, top_k), -1, dtype=torch.int32, device=device)
    if batch == 0:
        return out
    valid = top_k_tokens >= 0
    rows_l = req_rows.long()
    seq_cpu = seq_lens.tolist()
    rows_cpu = req_rows.tolist()
    hits = 0
    misses = 0

    # Fast path for every short request at once: identity placement.
    short = (seq_lens <= buffer_size).to(device)
    if bool(short.any()):
        take = valid & short.unsqueeze(1)
        safe = torch.where(take, top_k_tokens, 0).long()
        ident = buffer_slots[rows_l.unsqueeze(1).expand(-1, top_k), safe]
        out = torch.where(take, ident, out)
        hits += int(take.sum())

    for b in range(batch):
        seq_len = int(seq_cpu[b])
        if seq_len <= buffer_size:
            continue
        r = int(rows_cpu[b])
        tok = top_k_tokens[b]
        ok = valid[b]
        ring = ok & (tok >= buffer_size) & (tok >= seq_len - num_recent)
        ring_idx = ring.nonzero().squeeze(1)
        if ring_idx.numel():
            out[b, ring_idx] = buffer_slots[r, buffer_size + tok[ring_idx].long() % num_recent]
        cand_idx = (ok & ~ring).nonzero().squeeze(1)  # top-k indices looked up in the LRU table
        cand_tok = tok[cand_idx]

        # Table lookup by sorting the (distinct or −1) tokens held by the D positions.
        held = buffer_tokens[r]
        held_sorted, held_pos = torch.sort(held)
        where = torch.searchsorted(held_sorted, cand_tok).clamp_(max=buffer_size - 1)
        is_hit = held_sorted[where] == cand_tok
        hit_pos = held_pos[where[is_hit]]
        out[b, cand_idx[is_hit]] = buffer_slots[r, hit_pos.long()]
        miss_idx = cand_idx[~is_hit]
        miss_tok = cand_tok[~is_hit]
        num_miss = miss_idx.numel()

        order = lru_order[r]
        pos_is_hit = torch.zeros(buffer_size, dtype=torch.bool, device=device)
        pos_is_hit[hit_pos.long()] = True
        hit_in_order = pos_is_hit[order.long()]
        evictable = order[~hit_in_order]
        hit_order = order[hit_in_order]
        loaded = evictable[:num_miss]
        if num_miss:
            loaded_l = loaded.long()
            buffer_tokens[r, loaded_l] = miss_tok
            dst_slots = buffer_slots[r, loaded_l]
            out[b, miss_idx] = dst_slots
            src_rows = host_rows[r, miss_tok.long()].long()
            device_pool[dst_slots.long()] = host_pool[src_rows].to(device_pool.device, non_blocking=False)
        lru_order[r] = torch.cat([evictable[num_miss:], loaded, hit_order])
        hits += int(ring_idx.numel()) + int(hit_pos.numel())
        misses += num_miss
    if counters is not None:
        counters[0] += hits
        counters[1] += misses
    return out
