"""GPU kernels against their PyTorch references (run on the device machine: pytest -m gpu tests/kernels)."""

from __future__ import annotations

import random

import pytest
import torch
from kernels_swap_traces import POISON, assert_rows_resident, make_state, next_topk, write_current_token

from kernels import (
    BoundSwapIn,
    SwapInTables,
    backup_rows,
    indexer_topk,
    pack_fp8_rows,
    swap_in,
)
from kernels.dispatch import AUTO_COPY_BLOCKS, auto_copy_blocks, sparse_mla_decode_rows_ref
from kernels.indexer_ref import index_scores_ref, indexer_topk_ref, quantize_index_keys
from kernels.sparse_mla_triton import sparse_mla_decode_triton
from kernels.swap_in_ref import swap_in_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"


def _to_gpu_state(state):
    """Device copies of the tables and pools; the host pool pinned."""
    return {
        "buffer_slots": state.buffer_slots.to(DEV),
        "buffer_tokens": state.buffer_tokens.to(DEV),
        "lru_order": state.lru_order.to(DEV),
        "host_rows": state.host_rows.to(DEV),
        "host_pool": state.host_pool.pin_memory(),
        "device_pool": state.device_pool.to(DEV),
    }


def _gpu_tables(gpu, num_recent: int, counters: torch.Tensor | None) -> SwapInTables:
    """The swap-in's view of `_to_gpu_state`'s copies (the same tensors, updated in place by each call)."""
    return SwapInTables(gpu["buffer_slots"], gpu["buffer_tokens"], gpu["lru_order"], gpu["host_rows"],
                        gpu["host_pool"], gpu["device_pool"], num_recent, counters)


def _write_current_token_gpu(state, gpu) -> None:
    d, big_r = state.buffer_size, state.num_recent
    for r, n in zip(state.req_rows.tolist(), state.seq_lens.tolist(), strict=True):
        t = n - 1
        slot = state.buffer_slots[r, t] if n <= d else state.buffer_slots[r, d + t % big_r]
        gpu["device_pool"][int(slot)] = state.host_pool[state.host_rows[r, t]].to(DEV)


def run_gpu_trace(seed: int, seq_lens: list[int], buffer_size: int, top_k: int, num_recent: int, overlap: float,
                  steps: int, row_bytes: int) -> None:
    rng = random.Random(seed)
    state = make_state(rng, seq_lens, buffer_size, num_recent, row_bytes, max_steps=steps)
    gpu = _to_gpu_state(state)
    counters_ref = torch.zeros(2, dtype=torch.int64)
    counters_gpu = torch.zeros(2, dtype=torch.int64, device=DEV)
    for _ in range(steps):
        write_current_token(state)
        _write_current_token_gpu(state, gpu)
        topk = next_topk(rng, state, top_k, overlap)
        expect = swap_in_ref(topk, state.seq_lens, state.req_rows, state.tables(counters_ref))
        got = swap_in(topk.to(DEV), state.seq_lens.to(DEV), state.req_rows.to(DEV),
                      _gpu_tables(gpu, num_recent, counters_gpu))
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), expect), "slots differ from the reference"
        assert torch.equal(gpu["buffer_tokens"].cpu(), state.buffer_tokens), "buffer_tokens differ"
        assert torch.equal(gpu["lru_order"].cpu(), state.lru_order), "LRU order differs"
        assert torch.equal(gpu["device_pool"].cpu(), state.device_pool), "device pool differs"
        assert_rows_resident(state, topk, got.cpu(), gpu["device_pool"])
        assert counters_gpu.cpu().tolist() == counters_ref.tolist()
        state.seq_lens += 1


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("row_bytes", [656, 1152])
def test_swap_in_cuda_matches_reference_overlap(overlap: float, row_bytes: int) -> None:
    d, k = 256, 128
    lens = [d - 3, d, d + 1, 2 * d, 5 * d, 100, d - 1, 3 * d + 7]
    run_gpu_trace(int(overlap * 10) + row_bytes, lens, d, k, num_recent=4, overlap=overlap, steps=6,
                  row_bytes=row_bytes)


@pytest.mark.parametrize(("buffer_size", "top_k", "batch", "num_recent"),
                         [(64, 64, 1, 1), (96, 64, 5, 2), (2048, 2048, 3, 4), (4096, 2048, 17, 8),
                          (8192, 2048, 2, 4), (1500, 1000, 33, 3), (16384, 4096, 2, 2)])
def test_swap_in_cuda_matches_reference_shapes(buffer_size: int, top_k: int, batch: int, num_recent: int) -> None:
    rng = random.Random(buffer_size + batch)
    lens = [rng.choice([buffer_size - 1, buffer_size, buffer_size + 1, buffer_size + rng.randrange(1, 3 * buffer_size)])
            for _ in range(batch)]
    run_gpu_trace(buffer_size * 7 + top_k, lens, buffer_size, top_k, num_recent, overlap=0.6, steps=3, row_bytes=656)


def test_swap_in_cuda_rejects_small_buffer() -> None:
    rng = random.Random(0)
    st = make_state(rng, [10], buffer_size=16, num_recent=2, row_bytes=16, max_steps=1)
    gpu = _to_gpu_state(st)
    topk = torch.zeros(1, 32, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="must be >= top_k"):
        swap_in(topk, st.seq_lens.to(DEV), st.req_rows.to(DEV), _gpu_tables(gpu, 2, None))


@pytest.mark.parametrize("row_bytes", [100, 656, 1152, 1616])
@pytest.mark.parametrize(("buffer_size", "top_k", "num_recent", "max_copy_blocks"),
                         [(256, 128, 4, 0), (4096, 2048, 8, 0), (256, 128, 4, 1), (4096, 2048, 8, 3),
                          (256, 128, 4, AUTO_COPY_BLOCKS)])
def test_bound_swap_in_matches_unbound_and_reference(row_bytes: int, buffer_size: int, top_k: int,
                                                     num_recent: int, max_copy_blocks: int | str) -> None:
    """The backend's path (`BoundSwapIn`: tables bound once, checks on the first call of a signature) against the
    unbound call and the reference over a multi-step trace with misses: identical slots, device pool contents,
    buffer tokens, LRU order and counters after every step, while the batch shape changes between steps. With a
    copy-grid cap (a side stream's swap-in) the few blocks stride over every miss, each warp several rows at once
    (rows of 16-byte chunks, 2 or 3 a lane: 656 and 1152 B; one at a time beyond 96 chunks, 1616 B, and for rows
    not made of 16-byte chunks, 100 B): the same results."""
    rng = random.Random(row_bytes + buffer_size)
    d = buffer_size
    lens = [d - 2, d, d + 1, 2 * d + 3, 3 * d, 5 * d + 1, 100]
    steps = 6
    state = make_state(rng, lens, d, num_recent, row_bytes, max_steps=steps)
    unbound, bound_state = _to_gpu_state(state), _to_gpu_state(state)
    counters_ref = torch.zeros(2, dtype=torch.int64)
    counters_unbound = torch.zeros(2, dtype=torch.int64, device=DEV)
    counters_bound = torch.zeros(2, dtype=torch.int64, device=DEV)
    bound = BoundSwapIn(_gpu_tables(bound_state, num_recent, counters_bound))
    bound.max_copy_blocks = max_copy_blocks
    if max_copy_blocks != AUTO_COPY_BLOCKS:
        assert bound._context.max_copy_blocks == max_copy_blocks
    with pytest.raises(ValueError, match="max_copy_blocks"):
        bound.max_copy_blocks = -1
    all_rows, all_lens, all_prev = state.req_rows.clone(), state.seq_lens.clone(), state.prev_topk
    for step in range(steps):
        # Every other step a sub-batch (a new shape: checked once, then bound calls only).
        keep = list(range(len(lens))) if step % 2 == 0 else [1, 2, 3, 5]
        state.req_rows, state.seq_lens = all_rows[keep], all_lens[keep]
        state.prev_topk = [all_prev[i] for i in keep]
        write_current_token(state)
        _write_current_token_gpu(state, unbound)
        _write_current_token_gpu(state, bound_state)
        topk = next_topk(rng, state, top_k, overlap=0.5)
        for j, i in enumerate(keep):
            all_prev[i] = state.prev_topk[j]
        expect = swap_in_ref(topk, state.seq_lens, state.req_rows, state.tables(counters_ref))
        got_unbound = swap_in(topk.to(DEV), state.seq_lens.to(DEV), state.req_rows.to(DEV),
                              _gpu_tables(unbound, num_recent, counters_unbound))
        got_bound = bound(topk.to(DEV), state.seq_lens.to(DEV), state.req_rows.to(DEV))
        if max_copy_blocks == AUTO_COPY_BLOCKS:
            assert bound._context.max_copy_blocks == auto_copy_blocks(len(keep))
        torch.cuda.synchronize()
        assert got_bound.shape == expect.shape and got_bound.dtype == torch.int32
        assert torch.equal(got_bound.cpu(), expect) and torch.equal(got_unbound.cpu(), expect)
        for name in ("buffer_tokens", "lru_order", "device_pool"):
            assert torch.equal(bound_state[name].cpu(), getattr(state, name)), f"bound: {name} differs"
            assert torch.equal(unbound[name].cpu(), getattr(state, name)), f"unbound: {name} differs"
        assert counters_bound.cpu().tolist() == counters_unbound.cpu().tolist() == counters_ref.tolist()
        assert_rows_resident(state, topk, got_bound.cpu(), bound_state["device_pool"])
        all_lens[keep] += 1
    assert int(counters_ref[1]) > 0, "the trace must load rows from the host pool"
    # One check per argument signature: the two batch shapes (same dtypes and device every step).
    assert len(bound._checked_shapes) == 2
    assert {sig[0][0] for sig in bound._checked_shapes} == {torch.Size([len(lens), top_k]), torch.Size([4, top_k])}


def test_bound_swap_in_auto_cap_at_a_large_batch_matches_reference() -> None:
    """The "auto" cap at 130 requests (16 blocks, 4 FP8-sized rows a warp) and then at 40 (8 blocks): the
    reference's slots, device rows, tables and counters after every step."""
    rng = random.Random(130)
    d, top_k, num_recent = 256, 128, 4
    lens = [rng.randrange(d - 8, 5 * d) for _ in range(130)]
    state = make_state(rng, lens, d, num_recent, 656, max_steps=4)
    gpu = _to_gpu_state(state)
    counters_ref = torch.zeros(2, dtype=torch.int64)
    counters = torch.zeros(2, dtype=torch.int64, device=DEV)
    bound = BoundSwapIn(_gpu_tables(gpu, num_recent, counters))
    bound.max_copy_blocks = AUTO_COPY_BLOCKS
    all_rows, all_lens, all_prev = state.req_rows.clone(), state.seq_lens.clone(), state.prev_topk
    for step, batch in enumerate((130, 130, 40, 130)):
        keep = list(range(batch))
        state.req_rows, state.seq_lens = all_rows[keep], all_lens[keep]
        state.prev_topk = [all_prev[i] for i in keep]
        write_current_token(state)
        _write_current_token_gpu(state, gpu)
        topk = next_topk(rng, state, top_k, overlap=0.5)
        for j, i in enumerate(keep):
            all_prev[i] = state.prev_topk[j]
        expect = swap_in_ref(topk, state.seq_lens, state.req_rows, state.tables(counters_ref))
        got = bound(topk.to(DEV), state.seq_lens.to(DEV), state.req_rows.to(DEV))
        assert bound._context.max_copy_blocks == (16 if batch == 130 else 8), step
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), expect)
        for name in ("buffer_tokens", "lru_order", "device_pool"):
            assert torch.equal(gpu[name].cpu(), getattr(state, name)), f"step {step}: {name} differs"
        assert counters.cpu().tolist() == counters_ref.tolist()
        all_lens[keep] += 1
    assert int(counters_ref[1]) > 0, "the trace must load rows from the host pool"


def test_bound_swap_in_edge_cases() -> None:
    """Empty batch, seq_lens / req_rows of another dtype and device (converted as by the unbound call), the
    Python checks on a new shape (ValueError), and the extension's own check of a wrongly typed top-k on a shape
    already checked (RuntimeError, no crash)."""
    rng = random.Random(3)
    d, k, r = 64, 32, 2
    state = make_state(rng, [d + 10, 3 * d], d, r, 656, max_steps=2)
    gpu, ref_gpu = _to_gpu_state(state), _to_gpu_state(state)
    bound = BoundSwapIn(_gpu_tables(gpu, r, None))
    empty = bound(torch.zeros(0, k, dtype=torch.int32, device=DEV), torch.zeros(0, dtype=torch.int64, device=DEV),
                  torch.zeros(0, dtype=torch.int64, device=DEV))
    assert empty.shape == (0, k) and empty.dtype == torch.int32 and empty.is_cuda
    write_current_token(state)
    _write_current_token_gpu(state, gpu)
    _write_current_token_gpu(state, ref_gpu)
    topk = next_topk(rng, state, k, overlap=0.0).to(DEV)
    expect = swap_in(topk, state.seq_lens.to(DEV), state.req_rows.to(DEV), _gpu_tables(ref_gpu, r, None))
    got = bound(topk, state.seq_lens.int(), state.req_rows.int())  # CPU int32: converted in the extension
    torch.cuda.synchronize()
    assert torch.equal(got, expect) and torch.equal(gpu["device_pool"], ref_gpu["device_pool"])
    assert torch.equal(gpu["lru_order"], ref_gpu["lru_order"])
    with pytest.raises(ValueError, match="must be >= top_k"):
        bound(torch.zeros(1, 2 * d, dtype=torch.int32, device=DEV), state.seq_lens[:1].to(DEV),
              state.req_rows[:1].to(DEV))
    # Refused by the per-signature Python check before the extension sees them (see BoundSwapIn.__call__).
    with pytest.raises(ValueError, match="top_k_tokens must be"):
        bound(topk.long(), state.seq_lens.to(DEV), state.req_rows.to(DEV))
    with pytest.raises(ValueError, match="seq_lens and req_rows must be"):
        bound(topk, state.seq_lens[:1].to(DEV), state.req_rows.to(DEV))


def test_bound_swap_in_rejects_unpinned_host_pool() -> None:
    rng = random.Random(1)
    state = make_state(rng, [10], buffer_size=16, num_recent=2, row_bytes=16, max_steps=1)
    gpu = _to_gpu_state(state)
    gpu["host_pool"] = state.host_pool  # pageable
    with pytest.raises(ValueError, match="pinned"):
        BoundSwapIn(_gpu_tables(gpu, 2, None))


def _nan_poisoned_pool(rows: torch.Tensor, n_slots: int, fp8: bool, gen: torch.Generator):
    """Rows scattered into a larger pool whose other slots read as NaN; returns (pool, slot of each row)."""
    slots = torch.randperm(n_slots, generator=gen)[: rows.shape[0]]
    if fp8:
        packed = pack_fp8_rows(rows)
        pool = torch.full((n_slots, packed.shape[1]), POISON, dtype=torch.uint8)
        pool[slots] = packed
    else:
        pool = torch.full((n_slots, 576), float("nan"), dtype=torch.bfloat16)
        pool[slots] = rows.bfloat16()
    return pool.to(DEV), slots


def assert_matches_sparse_mla_reference(out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor,
                                        ref_lse: torch.Tensor, all_skipped_row: int | None) -> None:
    """A sparse MLA kernel's output against the reference: finite (poisoned slots never read), within 1 % in norm,
    the same infinite LSEs, finite LSEs close; a request with nothing selected gives zeros and LSE +inf."""
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), "NaN from an unselected (poisoned) slot or an empty row"
    err = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert err < 1e-2, f"norm-relative error {err:.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)
    if all_skipped_row is not None:
        row = all_skipped_row
        assert torch.equal(out[row].float(), torch.zeros_like(out[row].float())) and bool((lse[row] > 0).all())


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads", [16, 32, 64, 128])
@pytest.mark.parametrize(("batch", "top_k"), [(1, 2048), (3, 128), (17, 512)])
def test_sparse_mla_triton_matches_reference(fp8: bool, heads: int, batch: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(heads * 31 + batch + top_k + fp8)
    n_rows = top_k + 300
    rows = torch.randn(n_rows, 576, generator=gen)
    pool, slots = _nan_poisoned_pool(rows, 2 * n_rows + 11, fp8, gen)
    logical = torch.stack([torch.randperm(n_rows, generator=gen)[:top_k] for _ in range(batch)])
    indices = slots[logical].to(torch.int32)
    indices[0, top_k // 3:] = -1  # ragged padding
    if batch > 2:
        indices[1, ::5] = -1
        indices[2] = -1  # all invalid
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    indices = indices.to(DEV)
    out, lse = sparse_mla_decode_triton(q, pool, indices, 0.135)  # sparse_mla_decode runs Gluon on Hopper
    ref_out, ref_lse = sparse_mla_decode_rows_ref(q, pool, indices, 0.135)
    assert_matches_sparse_mla_reference(out, lse, ref_out, ref_lse, all_skipped_row=2 if batch > 2 else None)


def assert_independent_of_slot_placement(decode, fp8: bool, batch: int, heads: int, seed: int) -> None:
    """`decode(q, pool, indices, scale)` on the same rows in the same order held in other slots of differently
    poisoned pools gives the same bits (what HiSparse == dense rests on)."""
    gen = torch.Generator().manual_seed(seed)
    top_k = 1024
    rows = torch.randn(top_k * batch, 576, generator=gen)
    pool_a, slots_a = _nan_poisoned_pool(rows, 3 * rows.shape[0], fp8, gen)
    pool_b, slots_b = _nan_poisoned_pool(rows, 2 * rows.shape[0] + 77, fp8, gen)
    logical = torch.arange(top_k * batch).reshape(batch, top_k)
    logical = logical[:, torch.randperm(top_k, generator=gen)]
    idx_a = slots_a[logical].to(torch.int32)
    idx_b = slots_b[logical].to(torch.int32)
    idx_a[0, -100:] = -1
    idx_b[0, -100:] = -1
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    out_a, lse_a = decode(q, pool_a, idx_a.to(DEV), 0.1)
    out_b, lse_b = decode(q, pool_b, idx_b.to(DEV), 0.1)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 9])
def test_sparse_mla_triton_independent_of_slot_placement(fp8: bool, batch: int) -> None:
    """Same rows, same order, other slots: bit-identical output (HiSparse vs dense)."""
    assert_independent_of_slot_placement(sparse_mla_decode_triton, fp8, batch, 64, 5 + batch + fp8)


@pytest.mark.parametrize("heads", [16, 64])
def test_sparse_mla_triton_fp8_pool_off_16_byte_alignment_same_bits(heads: int) -> None:
    """The FP8 loop loads the RoPE part as 16-byte copies only when the pool is 16-byte aligned; a pool 4 bytes off
    takes the other path and must give the same bits."""
    gen = torch.Generator().manual_seed(heads)
    rows = torch.randn(700, 576, generator=gen)
    pool, slots = _nan_poisoned_pool(rows, 900, True, gen)
    shifted_storage = torch.empty(pool.numel() + 4, dtype=torch.uint8, device=DEV)
    shifted = shifted_storage[4:].view(pool.shape)
    shifted.copy_(pool)
    assert shifted.data_ptr() % 16 == 4
    indices = slots[torch.randperm(700, generator=gen)[:512].reshape(1, 512).repeat(5, 1)].to(torch.int32)
    indices[1, ::3] = -1
    q = torch.randn(5, heads, 576, generator=gen).bfloat16().to(DEV)
    out_a, lse_a = sparse_mla_decode_triton(q, pool, indices.to(DEV), 0.12)
    out_b, lse_b = sparse_mla_decode_triton(q, shifted, indices.to(DEV), 0.12)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_indexer_gpu_matches_reference() -> None:
    gen = torch.Generator().manual_seed(11)
    num_q, heads, n_keys, max_len, top_k = 12, 64, 5000, 3000, 256
    q = torch.randn(num_q, heads, 128, generator=gen)
    w = torch.rand(num_q, heads, generator=gen)
    keys, scales = quantize_index_keys(torch.randn(n_keys, 128, generator=gen))
    token_rows = torch.stack([torch.randperm(n_keys, generator=gen)[:max_len] for _ in range(4)]).to(torch.int32)
    token_req = torch.tensor([0, 1, 1, 2, 3, 0, 2, 3, 1, 0, 3, 2])
    seq_lens = torch.tensor([3000, 100, 256, 257, 2999, 1500, 700, 300, 2048, 5, 1024, 3000])
    ref = indexer_topk_ref(q, w, keys, scales, token_rows, token_req, seq_lens, top_k)
    got = indexer_topk(q.to(DEV), w.to(DEV), keys.to(DEV), scales.to(DEV), token_rows.to(DEV), token_req.to(DEV),
                       seq_lens.to(DEV), top_k).cpu()
    assert torch.equal(got < 0, ref < 0)
    for t in range(num_q):
        n = int(seq_lens[t])
        if n <= top_k:
            assert torch.equal(got[t], ref[t])
            continue
        rows = token_rows[token_req[t], :n].long()
        s = index_scores_ref(q[t:t + 1], w[t:t + 1], keys[rows], scales[rows])[0]
        assert len(set(got[t].tolist())) == top_k and int(got[t].max()) < n
        # Ties aside: the picked scores are the top_k scores. The GPU scores are within SCORE_ERROR_BOUND of the
        # largest score (kernels/indexer_fast.py, tests/kernels/test_indexer_gpu.py), so near-ties may flip.
        ref_sorted = s[ref[t].long()].sort(descending=True).values
        got_sorted = s[got[t].long()].sort(descending=True).values
        from kernels.indexer_fast import DEFAULT_CONFIG, SCORE_ERROR_BOUND

        bound = SCORE_ERROR_BOUND[DEFAULT_CONFIG.precision]
        assert torch.allclose(got_sorted, ref_sorted, rtol=0, atol=2 * bound * float(s.abs().max()))


@pytest.mark.parametrize("row_bytes", [656, 1152, 40])
def test_backup_rows_copies_all_layers(row_bytes: int) -> None:
    gen = torch.Generator().manual_seed(row_bytes)
    layers, n_dev, n_host, n = 5, 300, 900, 37
    device_pool = torch.randint(0, 255, (layers, n_dev, row_bytes), dtype=torch.uint8, generator=gen).to(DEV)
    host_pool = torch.zeros(layers, n_host, row_bytes, dtype=torch.uint8).pin_memory()
    src = torch.randperm(n_dev, generator=gen)[:n].to(DEV)
    dst = torch.randperm(n_host, generator=gen)[:n].to(DEV)
    expect = host_pool.clone()
    expect[:, dst.cpu()] = device_pool[:, src].cpu()
    event = backup_rows(device_pool, host_pool, src, dst)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    assert torch.equal(host_pool, expect)


@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize(("batch", "block_n"), [(3, 64), (17, 32)])
def test_sparse_mla_wide_variant_matches_reference_and_placement(heads: int, batch: int, block_n: int) -> None:
    """The float-row variant with one 512-wide tile (config WIDE=1): accuracy, poison, padding, placement."""
    from kernels.sparse_mla_triton import sparse_mla_decode_triton

    cfg = {"BLOCK_H": min(heads, 64), "BLOCK_N": block_n, "num_warps": 8 if heads >= 64 else 4, "num_stages": 2,
           "WIDE": 1}
    gen = torch.Generator().manual_seed(heads + batch)
    top_k, n_rows = 512, 900
    rows = torch.randn(n_rows, 576, generator=gen)
    pool_a, slots_a = _nan_poisoned_pool(rows, 2 * n_rows + 5, False, gen)
    pool_b, slots_b = _nan_poisoned_pool(rows, 3 * n_rows, False, gen)
    logical = torch.stack([torch.randperm(n_rows, generator=gen)[:top_k] for _ in range(batch)])
    idx_a = slots_a[logical].to(torch.int32)
    idx_b = slots_b[logical].to(torch.int32)
    for idx in (idx_a, idx_b):
        idx[0, top_k // 3:] = -1
        idx[2] = -1
    q = torch.randn(batch, heads, 576, generator=gen).bfloat16().to(DEV)
    out, lse = sparse_mla_decode_triton(q, pool_a, idx_a.to(DEV), 0.135, cfg)
    out_b, lse_b = sparse_mla_decode_triton(q, pool_b, idx_b.to(DEV), 0.135, cfg)
    ref_out, ref_lse = sparse_mla_decode_rows_ref(q, pool_a, idx_a.to(DEV), 0.135)
    assert torch.isfinite(out.float()).all()
    err = (out.float() - ref_out.float()).norm() / ref_out.float().norm()
    assert err < 1e-2, f"norm-relative error {err:.2e}"
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse)) and bool((lse[2] > 0).all())
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], atol=1e-3, rtol=1e-4)
    assert torch.equal(out, out_b) and torch.equal(lse, lse_b)
