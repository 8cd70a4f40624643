"""Paged allocation, token tables and the dense backend's placement-independence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.overrides import TorchFunctionMode

from decode_server.engine.dense_backend import DenseBackend, DenseKVCache
from decode_server.engine.forward_batch import SCRATCH_SLOTS, ForwardBatch
from decode_server.engine.forward_context import forward_context
from decode_server.engine.kv_alloc import OutOfSlotsError, PagedAllocator, RequestTokenTable
from kernels.indexer_ref import quantize_index_keys


def test_allocator_accounting_and_errors() -> None:
    alloc = PagedAllocator(100, 16)
    assert alloc.num_pages == 6 and alloc.num_free_pages == 6
    pages = alloc.allocate(4)
    assert len(set(pages)) == 4 and alloc.num_used_pages == 4
    with pytest.raises(OutOfSlotsError):
        alloc.allocate(3)
    alloc.free(pages)
    assert alloc.num_free_pages == 6
    with pytest.raises(RuntimeError, match="double free"):
        alloc.free([0])
    with pytest.raises(ValueError):
        PagedAllocator(8, 16)


def test_token_table_grows_by_pages_and_releases() -> None:
    alloc = PagedAllocator(64, 8)
    table = RequestTokenTable(alloc, max_requests=2, max_context=40, device="cpu")
    table.ensure(1, 10)
    assert table.capacity(1) == 16 and alloc.num_used_pages == 2
    table.ensure(1, 16)
    assert alloc.num_used_pages == 2
    table.ensure(1, 17)
    slots = table.slots(1, 17)
    assert len(set(slots.tolist())) == 17 and (slots >= 0).all()
    assert (table.table[1, 24:] == -1).all()
    with pytest.raises(OutOfSlotsError):
        table.ensure(0, 41)
    table.release(1)
    assert alloc.num_used_pages == 0 and (table.table == -1).all()


def _run_layer(cache: DenseKVCache, rows: list[int], lens: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    backend = DenseBackend(cache)
    for r, n in zip(rows, lens, strict=True):
        backend.reserve(r, n)
    batch = ForwardBatch.build(rows, [0] * len(rows), lens, "cpu")
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)
    with forward_context(batch, backend):
        backend.write_kv(0, torch.randn(t, 576, generator=g))
        keys, scales = quantize_index_keys(torch.randn(t, 128, generator=g))
        backend.write_index_keys(0, keys, scales)
        topk = backend.index_topk(0, torch.randn(t, 4, 128, generator=g), torch.rand(t, 4, generator=g), 32)
        out = backend.sparse_attention(0, torch.randn(t, 8, 576, generator=g), topk, 0.07)
    return topk, out


def test_dense_attention_is_independent_of_slot_placement() -> None:
    lens = [70, 5, 40]
    a = DenseKVCache(1, 512, 4, 128, torch.float32, "cpu", page_size=16)
    b = DenseKVCache(1, 512, 4, 128, torch.float32, "cpu", page_size=16)
    b.allocator.allocate(7)  # shift every later page: same tokens, other slots
    b.kv.fill_(float("nan"))  # unused rows poisoned: any stray read shows up as NaN
    topk_a, out_a = _run_layer(a, [0, 1, 2], lens, seed=3)
    topk_b, out_b = _run_layer(b, [3, 0, 1], lens, seed=3)
    assert torch.equal(topk_a, topk_b)
    assert torch.equal(out_a, out_b)
    assert not out_a.isnan().any()
    # Causal short prefixes are dense: token p of a request attends to positions 0..p.
    assert topk_a[70 + 2, :4].tolist() == [0, 1, 2, -1]


def test_forward_without_reservation_is_an_error() -> None:
    cache = DenseKVCache(1, 64, 2, 64, torch.float32, "cpu", page_size=16)
    backend = DenseBackend(cache)
    batch = ForwardBatch.build([0], [0], [4], "cpu")
    with pytest.raises(RuntimeError, match="slots reserved"), forward_context(batch, backend):
        pass


def test_fp8_cache_stores_packed_rows_and_attends_over_them() -> None:
    """FP8 KV: 656 B FlashMLA rows in the cache, placement-independent, and the attention is the float
    attention over the dequantized rows (exactly), close to the attention over the unquantized rows."""
    from kernels.fp8_rows import pack_fp8_rows, unpack_fp8_rows

    lens = [70, 5, 40]
    fp8 = torch.float8_e4m3fn
    a = DenseKVCache(1, 512, 4, 128, fp8, "cpu", page_size=16)
    b = DenseKVCache(1, 512, 4, 128, fp8, "cpu", page_size=16)
    assert a.kv.shape == (1, 512 + SCRATCH_SLOTS, 656) and a.kv.dtype == torch.uint8  # + padded rows' scratch
    assert DenseKVCache.bytes_per_token(2, fp8) == 2 * (656 + 132)
    b.allocator.allocate(7)
    b.kv.fill_(0xFF)  # NaN in e4m3 and in the fp32 scales: any stray read shows up as NaN
    topk_a, out_a = _run_layer(a, [0, 1, 2], lens, seed=3)
    topk_b, out_b = _run_layer(b, [3, 0, 1], lens, seed=3)
    assert torch.equal(topk_a, topk_b) and torch.equal(out_a, out_b)
    assert not out_a.isnan().any()

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(sum(lens), 576, generator=g)  # what _run_layer wrote, in token order
    slots = torch.cat([a.tokens.slots(r, n) for r, n in zip([0, 1, 2], lens, strict=True)]).long()
    assert torch.equal(a.kv[0, slots], pack_fp8_rows(rows))
    dequantized = DenseKVCache(1, 512, 4, 128, torch.float32, "cpu", page_size=16)
    exact = DenseKVCache(1, 512, 4, 128, torch.float32, "cpu", page_size=16)
    _, out_deq = _run_layer_with_rows(dequantized, lens, unpack_fp8_rows(pack_fp8_rows(rows)), seed=3)
    _, out_exact = _run_layer_with_rows(exact, lens, rows, seed=3)
    assert torch.equal(out_a, out_deq)
    # Measured (seeds 3-5): relative error 0.037, max |Δ| 0.20-0.23 on outputs of std 0.53; the rows themselves
    # round-trip with relative error 0.025 (e4m3: 3 mantissa bits; per-128 power-of-two scales).
    rel = (out_a - out_exact).norm() / out_exact.norm()
    assert rel < 0.05, f"FP8 attention relative error {rel:.3f}"


def _run_layer_with_rows(
    cache: DenseKVCache, lens: list[int], rows: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """_run_layer with the MLA rows replaced (same random stream otherwise)."""
    original = DenseBackend.write_kv

    def write(self: DenseBackend, layer_id: int, kv_rows: torch.Tensor) -> None:
        original(self, layer_id, rows)

    DenseBackend.write_kv = write
    try:
        return _run_layer(cache, [0, 1, 2], lens, seed)
    finally:
        DenseBackend.write_kv = original


class _TableGathers(TorchFunctionMode):
    """Counts the indexer's row gathers from `table` (`table[req_rows, :width]`: a slice for the columns)."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.table = table
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (func is torch.Tensor.__getitem__ and args[0] is self.table and isinstance(args[1], tuple)
                and isinstance(args[1][-1], slice)):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_indexer_token_rows_are_gathered_once_a_forward(monkeypatch) -> None:
    """Every layer's indexer gets the one [B, width] tensor that begin_forward gathered (one gather a forward,
    not one a layer), with the same selections as a gather of its own would give; nothing holds it after the
    forward. A prefill forward (width: the longest sequence) and a static decode one (width: index_width)."""
    from decode_server.engine import dense_backend

    layers, lens = 4, [70, 5, 40]
    cache = DenseKVCache(layers, 512, 4, 128, torch.float32, "cpu", page_size=16)
    backend = DenseBackend(cache)
    for r, n in enumerate(lens):
        backend.reserve(r, n + 1)
    seen: list[torch.Tensor] = []
    original = dense_backend.indexer_topk

    def recording(q, weights, keys, scales, token_rows, token_req, seq_lens, top_k, reference=False,
                  tables_ready=False):
        assert tables_ready  # gathered in begin_forward, before the write that precedes the scores
        seen.append(token_rows)
        got = original(q, weights, keys, scales, token_rows, token_req, seq_lens, top_k, reference, tables_ready)
        batch = backend._batch
        own = cache.tokens.table.clone()[batch.req_rows, : batch.token_table_width()]  # as each layer gathered
        assert torch.equal(got, original(q, weights, keys, scales, own, token_req, seq_lens, top_k, reference))
        return got

    monkeypatch.setattr(dense_backend, "indexer_topk", recording)
    g = torch.Generator().manual_seed(5)
    decode = dataclasses.replace(ForwardBatch.build([0, 1, 2], lens, [1, 1, 1], "cpu"), static=True,
                                 index_width=128)  # as the graph runner's static batches: the table's width
    for batch, width in ((ForwardBatch.build([0, 1, 2], [0, 0, 0], lens, "cpu"), max(lens)), (decode, 128)):
        seen.clear()
        t = batch.num_tokens
        with _TableGathers(cache.tokens.table) as gathers, forward_context(batch, backend):
            for layer in range(layers):
                backend.write_kv(layer, torch.randn(t, 576, generator=g))
                backend.write_index_keys(layer, *quantize_index_keys(torch.randn(t, 128, generator=g)))
                backend.index_topk(layer, torch.randn(t, 4, 128, generator=g), torch.rand(t, 4, generator=g), 32)
        assert gathers.count == 1
        assert len(seen) == layers and all(rows is seen[0] for rows in seen)
        assert seen[0].shape == (3, width)
        assert backend._token_rows is None
