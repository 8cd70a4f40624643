"""HiSparse swap-in, PyTorch reference (the CPU path of the engine and the oracle of the CUDA kernel).

For one layer and a batch, map each request's top-k token positions to device slots, loading the misses
from the host pool into least-recently-used device slots. The layer's tables are one `SwapInTables`
(kernels/swap_in_tables.py), which also holds the argument checks every implementation shares. The layout is
docs/architecture.md "HiSparse memory layout"; in short, for request row r with `seq_len` tokens (the current one
included):

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

from kernels.swap_in_tables import SwapInTables


def swap_in_ref(
    top_k_tokens: torch.Tensor, seq_lens: torch.Tensor, req_rows: torch.Tensor, tables: SwapInTables
) -> torch.Tensor:
    """Map top-k positions [B, K] to device slots [B, K] int32 (−1 stays −1) against one layer's `tables`,
    updating them; see the module docstring."""
    batch, top_k, buffer_size = tables.check(top_k_tokens, seq_lens, req_rows)
    buffer_slots, buffer_tokens, lru_order = tables.buffer_slots, tables.buffer_tokens, tables.lru_order
    host_rows, host_pool, device_pool = tables.host_rows, tables.host_pool, tables.device_pool
    num_recent, counters = tables.num_recent, tables.counters
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
