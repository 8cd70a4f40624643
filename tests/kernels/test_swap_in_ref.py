"""swap_in_ref against a token-by-token simulation of the HiSparse layout over random multi-step traces."""

from __future__ import annotations

import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from kernels_swap_traces import (
    assert_rows_resident,
    brute_force_swap_in,
    make_state,
    next_topk,
    write_current_token,
)

import kernels
from kernels import BoundSwapIn, SwapInTables, swap_in
from kernels.dispatch import AUTO_COPY_BLOCKS, auto_copy_blocks
from kernels.swap_in_ref import swap_in_ref


def run_trace(seed: int, seq_lens: list[int], buffer_size: int, top_k: int, num_recent: int, overlap: float,
              steps: int, impl=swap_in_ref) -> None:
    rng = random.Random(seed)
    ref = make_state(rng, seq_lens, buffer_size, num_recent, row_bytes=48, max_steps=steps)
    sim = ref.clone()
    counters = torch.zeros(2, dtype=torch.int64)
    total_hits = total_misses = 0
    for _ in range(steps):
        write_current_token(ref)
        write_current_token(sim)
        topk = next_topk(rng, ref, top_k, overlap)
        sim.prev_topk = [list(x) for x in ref.prev_topk]
        slots = impl(topk, ref.seq_lens, ref.req_rows, ref.tables(counters))
        expect, hits, misses = brute_force_swap_in(sim, topk)
        total_hits += hits
        total_misses += misses
        assert torch.equal(slots, expect)
        assert torch.equal(ref.buffer_tokens, sim.buffer_tokens)
        assert torch.equal(ref.lru_order, sim.lru_order)
        assert torch.equal(ref.device_pool, sim.device_pool)
        assert_rows_resident(ref, topk, slots)
        assert counters.tolist() == [total_hits, total_misses]
        ref.seq_lens += 1
        sim.seq_lens += 1
    assert total_hits > 0 and total_misses > 0, "the trace must exercise both hits and misses"


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.8, 1.0])
def test_ref_matches_simulation_long_and_transition(overlap: float) -> None:
    run_trace(seed=int(overlap * 100), seq_lens=[30, 31, 45, 90, 12], buffer_size=32, top_k=16, num_recent=3,
              overlap=overlap, steps=12)


@pytest.mark.parametrize(("buffer_size", "top_k", "num_recent"), [(16, 16, 1), (64, 16, 4), (40, 32, 2)])
def test_ref_matches_simulation_shapes(buffer_size: int, top_k: int, num_recent: int) -> None:
    lens = [buffer_size - 2, buffer_size, buffer_size + 1, 3 * buffer_size, top_k // 2]
    run_trace(seed=buffer_size + top_k, seq_lens=lens, buffer_size=buffer_size, top_k=top_k,
              num_recent=num_recent, overlap=0.6, steps=8)


def test_dispatcher_on_cpu_is_reference() -> None:
    run_trace(seed=7, seq_lens=[20, 50], buffer_size=24, top_k=8, num_recent=2, overlap=0.5, steps=6, impl=swap_in)


def test_fast_path_is_identity_and_touches_nothing() -> None:
    rng = random.Random(3)
    st = make_state(rng, [5, 9], buffer_size=16, num_recent=2, row_bytes=16, max_steps=1)
    before = st.clone()
    topk = torch.tensor([[4, 0, -1, 2], [8, -1, -1, 1]], dtype=torch.int32)
    slots = swap_in_ref(topk, st.seq_lens, st.req_rows, st.tables())
    rows = st.req_rows.long()
    for b in range(2):
        for i in range(4):
            t = int(topk[b, i])
            assert int(slots[b, i]) == (-1 if t < 0 else int(st.buffer_slots[rows[b], t]))
    assert torch.equal(st.buffer_tokens, before.buffer_tokens)
    assert torch.equal(st.lru_order, before.lru_order)
    assert torch.equal(st.device_pool, before.device_pool)


def test_lru_order_after_one_step() -> None:
    """Hand-checked case: D=4, R=1, positions hold tokens [10, 11, 12, 13], LRU order [2, 0, 3, 1]."""
    d = 4
    buffer_slots = torch.tensor([[100, 101, 102, 103, 104]], dtype=torch.int32)
    buffer_tokens = torch.tensor([[10, 11, 12, 13]], dtype=torch.int32)
    lru = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    host_rows = torch.arange(64, dtype=torch.int32).unsqueeze(0)
    host_pool = torch.arange(64, dtype=torch.uint8).unsqueeze(1).repeat(1, 16)
    device_pool = torch.full((105, 16), 255, dtype=torch.uint8)
    counters = torch.zeros(2, dtype=torch.int64)
    # seq_len 40: token 39 is in the ring; 13 and 11 hit; 5 and 7 miss.
    topk = torch.tensor([[5, 13, 39, 7, 11, -1]], dtype=torch.int32)
    tables = SwapInTables(buffer_slots, buffer_tokens, lru, host_rows, host_pool, device_pool, 1, counters)
    with pytest.raises(ValueError, match="must be >= top_k"):
        swap_in_ref(topk, torch.tensor([40]), torch.tensor([0]), tables)
    topk = torch.tensor([[5, 13, 39, 7]], dtype=torch.int32)
    slots = swap_in_ref(topk, torch.tensor([40]), torch.tensor([0]), tables)
    # hit: position 3 (token 13). Evictable in LRU order: 2, 0, 1 → 5 takes 2, 7 takes 0. Stale: 1.
    assert slots.tolist() == [[102, 103, 104, 100]]
    assert buffer_tokens.tolist() == [[7, 11, 5, 13]]
    assert lru.tolist() == [[1, 2, 0, 3]]
    assert counters.tolist() == [2, 2]
    assert device_pool[102].tolist() == [5] * 16 and device_pool[100].tolist() == [7] * 16
    assert d == 4


def test_bound_swap_in_on_cpu_is_reference() -> None:
    """`BoundSwapIn` (the HiSparse backend's per-layer path) on CPU tensors: the reference over a whole trace."""
    bound: dict[str, BoundSwapIn] = {}

    def impl(top_k, seq_lens, req_rows, tables):
        swap = bound.setdefault("swap", BoundSwapIn(tables))
        assert all(getattr(swap.tables, f.name) is getattr(tables, f.name) for f in dataclasses.fields(tables))
        return swap(top_k, seq_lens, req_rows)

    run_trace(seed=9, seq_lens=[20, 50, 23], buffer_size=24, top_k=8, num_recent=2, overlap=0.5, steps=6, impl=impl)


def test_auto_copy_blocks_follow_the_batch() -> None:
    """The side-stream copy cap "auto": 8 blocks up to 64 requests, then one per 8 requests, at most 16."""
    assert [auto_copy_blocks(b) for b in (1, 8, 42, 48, 64, 65, 72, 96, 120, 121, 128, 256, 4096)] == [
        8, 8, 8, 8, 8, 9, 9, 12, 15, 16, 16, 16, 16]


def test_bound_swap_in_copy_cap_values() -> None:
    """`max_copy_blocks` takes a block count (0: no cap) or "auto"; anything else is refused, the last good value
    kept. On the CPU the cap has no grid to act on, and "auto" leaves the reference's results alone."""
    state = make_state(random.Random(3), [10, 40], buffer_size=16, num_recent=2, row_bytes=8, max_steps=2)
    swap = BoundSwapIn(state.tables())
    assert swap.max_copy_blocks == 0
    for good in (24, 0, AUTO_COPY_BLOCKS):
        swap.max_copy_blocks = good
        assert swap.max_copy_blocks == good
    for bad in (-1, "eight", "Auto"):
        with pytest.raises(ValueError, match="max_copy_blocks"):
            swap.max_copy_blocks = bad
        assert swap.max_copy_blocks == AUTO_COPY_BLOCKS


def test_bound_swap_in_with_auto_cap_on_cpu_is_reference() -> None:
    """A bound swap-in with the "auto" cap over a whole trace: the reference's results (the cap only sizes a GPU
    grid)."""
    bound: dict[str, BoundSwapIn] = {}

    def impl(top_k, seq_lens, req_rows, tables):
        if "swap" not in bound:
            bound["swap"] = BoundSwapIn(tables)
            bound["swap"].max_copy_blocks = AUTO_COPY_BLOCKS
        return bound["swap"](top_k, seq_lens, req_rows)

    run_trace(seed=10, seq_lens=[20, 50, 23], buffer_size=24, top_k=8, num_recent=2, overlap=0.5, steps=6, impl=impl)


def test_bound_swap_in_checks_each_shape_once() -> None:
    calls: list[tuple[int, ...]] = []
    state = make_state(random.Random(2), [10, 40], buffer_size=16, num_recent=2, row_bytes=8, max_steps=4)
    swap = BoundSwapIn(state.tables())
    original = swap._check  # the bound check (the CPU reference behind it checks every call on its own)

    def counting(top_k, *args):
        calls.append(tuple(top_k.shape))
        return original(top_k, *args)

    swap._check = counting
    for k in (8, 8, 4, 8, 4):
        swap(torch.full((2, k), -1, dtype=torch.int32), state.seq_lens, state.req_rows)
    assert calls == [(2, 8), (2, 4)]
    with pytest.raises(ValueError, match="must be >= top_k"):  # a new shape is checked before anything runs
        swap(torch.full((2, 32), -1, dtype=torch.int32), state.seq_lens, state.req_rows)
    assert calls[-1] == (2, 32) and all(sig[0][0] != (2, 32) for sig in swap._checked_shapes)
    swap(torch.full((2, 8), -1, dtype=torch.int32), state.seq_lens.int(), state.req_rows)  # new dtype: checked
    assert calls[-1] == (2, 8) and len(calls) == 4
    with pytest.raises(ValueError, match="must be \\[B, K\\] int32"):  # an int64 top-k of a checked shape
        swap(torch.full((2, 8), -1, dtype=torch.int64), state.seq_lens, state.req_rows)


def test_tables_unpack_in_the_extension_argument_order() -> None:
    """The CUDA path passes `SwapInTables.extension_args()` to the extension's `swap_in` (after the batch, before
    the copy-grid cap) and to `SwapInContext`: their parameters in kernels/csrc/hisparse_kernels.cu must be the
    tables' fields, in order."""
    source = (Path(kernels.__file__).parent / "csrc" / "hisparse_kernels.cu").read_text()
    fields = [f.name for f in dataclasses.fields(SwapInTables)]
    context = re.search(r'class_<SwapInContext>.*?pybind11::init<.*?>>\(\),(.*?)\)\s*\.def\("__call__"', source, re.S)
    assert context is not None
    assert re.findall(r'arg\("(\w+)"\)', context.group(1)) == fields
    unbound = re.search(r"torch::Tensor swap_in\((.*?)\)\s*\{", source, re.S)
    assert unbound is not None
    params = [p.split()[-1] for p in unbound.group(1).split(",")]
    assert params == ["top_k", "seq_lens", "req_rows", *fields, "max_copy_blocks"]  # the grid cap after the tables
    state = make_state(random.Random(1), [10], buffer_size=16, num_recent=2, row_bytes=8, max_steps=1)
    counters = torch.zeros(2, dtype=torch.int64)
    args = state.tables(counters).extension_args()
    assert [type(a) for a in args[:6]] == [torch.Tensor] * 6 and args[6] == 2 and type(args[6]) is int
    assert all(a is getattr(state, f) for a, f in zip(args[:6], fields[:6], strict=True)) and args[7] is counters
