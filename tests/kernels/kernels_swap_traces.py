"""Multi-step swap-in traces and a brute-force simulator of the HiSparse layout (docs/architecture.md).

Shared by the CPU tests of the reference and the GPU tests of the CUDA kernel. The simulator is written
token by token in plain Python, independently of kernels/swap_in_ref.py, straight from the layout's rules.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kernels import SwapInTables

POISON = 0xFF  # a byte pattern that reads as NaN in bf16, fp32 and e4m3


@dataclass
class SwapState:
    """All tensors of one layer for a batch of requests (CPU tensors; tests move them where they need)."""

    buffer_size: int
    num_recent: int
    row_bytes: int
    req_rows: torch.Tensor
    seq_lens: torch.Tensor
    buffer_slots: torch.Tensor
    buffer_tokens: torch.Tensor
    lru_order: torch.Tensor
    host_rows: torch.Tensor
    host_pool: torch.Tensor
    device_pool: torch.Tensor
    prev_topk: list[list[int]] = field(default_factory=list)

    def tables(self, counters: torch.Tensor | None = None) -> SwapInTables:
        """This state's tables, pools and `counters` as the swap-in takes them (the same tensors, updated in place)."""
        return SwapInTables(self.buffer_slots, self.buffer_tokens, self.lru_order, self.host_rows, self.host_pool,
                            self.device_pool, self.num_recent, counters)  # fmt: skip

    def clone(self) -> SwapState:
        return SwapState(
            self.buffer_size, self.num_recent, self.row_bytes, self.req_rows.clone(), self.seq_lens.clone(),
            self.buffer_slots.clone(), self.buffer_tokens.clone(), self.lru_order.clone(), self.host_rows.clone(),
            self.host_pool.clone(), self.device_pool.clone(), [list(x) for x in self.prev_topk],
        )


def make_state(
    rng: random.Random, seq_lens: list[int], buffer_size: int, num_recent: int, row_bytes: int, max_steps: int,
    spare_reqs: int = 2,
) -> SwapState:
    """Requests at the given lengths; short ones in identity placement, long ones cold (empty LRU table)."""
    batch = len(seq_lens)
    max_reqs = batch + spare_reqs
    max_ctx = max(seq_lens) + max_steps + 1
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    rows = rng.sample(range(max_reqs), batch)
    width = buffer_size + num_recent
    n_dev = max_reqs * width + 7
    perm = torch.randperm(n_dev, generator=gen)[: max_reqs * width].to(torch.int32)
    buffer_slots = perm.reshape(max_reqs, width)
    n_host = max_reqs * max_ctx + 5
    host_perm = torch.randperm(n_host, generator=gen)[: max_reqs * max_ctx].to(torch.int32)
    host_rows = host_perm.reshape(max_reqs, max_ctx)
    host_pool = torch.randint(0, 120, (n_host, row_bytes), dtype=torch.uint8, generator=gen)
    device_pool = torch.full((n_dev, row_bytes), POISON, dtype=torch.uint8)
    buffer_tokens = torch.arange(buffer_size, dtype=torch.int32).repeat(max_reqs, 1)
    lru_order = torch.arange(buffer_size, dtype=torch.int32).repeat(max_reqs, 1)
    for r, n in zip(rows, seq_lens, strict=True):
        if n <= buffer_size:  # identity placement of the tokens written so far
            device_pool[buffer_slots[r, :n].long()] = host_pool[host_rows[r, :n].long()]
        else:
            buffer_tokens[r] = -1
            lru_order[r] = torch.tensor(rng.sample(range(buffer_size), buffer_size), dtype=torch.int32)
            recent = torch.arange(max(buffer_size, n - num_recent), n - 1)
            ring = buffer_slots[r, buffer_size + recent % num_recent].long()
            device_pool[ring] = host_pool[host_rows[r, recent].long()]
    return SwapState(
        buffer_size, num_recent, row_bytes, torch.tensor(rows, dtype=torch.int64),
        torch.tensor(seq_lens, dtype=torch.int64), buffer_slots, buffer_tokens, lru_order, host_rows, host_pool,
        device_pool, [[] for _ in seq_lens],
    )


def write_current_token(state: SwapState) -> None:
    """What write_kv does before attention: the current token's row goes to its slot (identity or ring)."""
    d, big_r = state.buffer_size, state.num_recent
    for r, n in zip(state.req_rows.tolist(), state.seq_lens.tolist(), strict=True):
        t = n - 1
        slot = state.buffer_slots[r, t] if n <= d else state.buffer_slots[r, d + t % big_r]
        state.device_pool[slot] = state.host_pool[state.host_rows[r, t]]


def next_topk(rng: random.Random, state: SwapState, top_k: int, overlap: float, pad_prob: float = 0.2) -> torch.Tensor:
    """One step's [B, K] top-k: `overlap` of it kept from the previous step, the rest new, in random order.

    Short requests (seq_len <= K) select every position in order, as the indexer does; some long ones get
    ragged −1 padding to exercise it on the long path too.
    """
    out = torch.full((len(state.prev_topk), top_k), -1, dtype=torch.int32)
    for b, n in enumerate(state.seq_lens.tolist()):
        if n <= top_k:
            chosen = list(range(n))
        else:
            want = top_k if rng.random() > pad_prob else rng.randrange(1, top_k + 1)
            prev = [t for t in state.prev_topk[b] if t < n]
            keep = rng.sample(prev, min(len(prev), round(overlap * want)))
            kept = set(keep)
            if n - 1 not in kept and rng.random() < 0.7 and len(keep) < want:
                keep.append(n - 1)  # the newest tokens are popular picks
                kept.add(n - 1)
            fresh = []
            while len(keep) + len(fresh) < want:
                t = rng.randrange(n)
                if t not in kept:
                    kept.add(t)
                    fresh.append(t)
            chosen = keep + fresh
            rng.shuffle(chosen)
            if want < top_k:
                slots = sorted(rng.sample(range(top_k), want))
                row = [-1] * top_k
                for s, t in zip(slots, chosen, strict=True):
                    row[s] = t
                out[b] = torch.tensor(row, dtype=torch.int32)
                state.prev_topk[b] = chosen
                continue
        out[b, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        state.prev_topk[b] = chosen
    return out


def brute_force_swap_in(state: SwapState, top_k_tokens: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The layout's rules applied token by token; updates `state` in place. Returns (slots, hits, misses)."""
    d, big_r = state.buffer_size, state.num_recent
    out = torch.full(top_k_tokens.shape, -1, dtype=torch.int32)
    hits = misses = 0
    for b, (r, n) in enumerate(zip(state.req_rows.tolist(), state.seq_lens.tolist(), strict=True)):
        toks = top_k_tokens[b].tolist()
        slots = state.buffer_slots[r].tolist()
        if n <= d:
            for i, t in enumerate(toks):
                if t >= 0:
                    out[b, i] = slots[t]
                    hits += 1
            continue
        held = state.buffer_tokens[r].tolist()
        where = {t: j for j, t in enumerate(held) if t >= 0}
        lru = state.lru_order[r].tolist()
        hit_pos: set[int] = set()
        miss_list: list[int] = []
        for i, t in enumerate(toks):
            if t < 0:
                continue
            if t >= d and t >= n - big_r:
                out[b, i] = slots[d + t % big_r]
                hits += 1
            elif t in where:
                out[b, i] = slots[where[t]]
                hit_pos.add(where[t])
                hits += 1
            else:
                miss_list.append(i)
        evictable = [j for j in lru if j not in hit_pos]
        for m, i in enumerate(miss_list):
            j = evictable[m]
            t = toks[i]
            held[j] = t
            out[b, i] = slots[j]
            state.device_pool[slots[j]] = state.host_pool[state.host_rows[r, t]]
        misses += len(miss_list)
        used = len(miss_list)
        new_lru = evictable[used:] + evictable[:used] + [j for j in lru if j in hit_pos]
        state.buffer_tokens[r] = torch.tensor(held, dtype=torch.int32)
        state.lru_order[r] = torch.tensor(new_lru, dtype=torch.int32)
    return out, hits, misses


def assert_rows_resident(state: SwapState, top_k_tokens: torch.Tensor, slots: torch.Tensor,
                         device_pool: torch.Tensor | None = None) -> None:
    """Every selected token's device row equals its host row (the point of swap-in)."""
    pool = state.device_pool if device_pool is None else device_pool
    valid = top_k_tokens >= 0
    assert torch.equal(slots < 0, ~valid), "−1 must map to −1 and only −1"
    b_idx, i_idx = valid.nonzero(as_tuple=True)
    toks = top_k_tokens[b_idx, i_idx].long()
    rows = state.req_rows[b_idx]
    host = state.host_pool[state.host_rows[rows, toks].long()]
    dev = pool[slots[b_idx, i_idx].long()].cpu()
    assert torch.equal(dev, host), "a selected token's device row differs from its host row"
