"""HiSparse must be bit-identical to dense: same greedy tokens, same logits (torch.equal), with requests of
different lengths joining and leaving at different steps, a device buffer smaller than the prompts, and with
retractions forced by a tiny indexer-key budget."""

from __future__ import annotations

import pytest
import torch
from harness import TOP_K, Arrival, assert_identical, make_engine, random_prompt, run_script


def workload(seed: int = 0) -> list[Arrival]:
    gen = torch.Generator().manual_seed(seed)
    # Prompts shorter and longer than the buffer (D = top_k = 64); the 120-token prompt needs 2 prefill chunks;
    # the 56-token one crosses D during decode (fast path → ring + LRU).
    spec = [(0, 20, 4), (0, 120, 12), (2, 90, 16), (4, 56, 14), (7, 70, 4)]
    return [Arrival(step, f"r{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def test_hisparse_matches_dense_bit_for_bit(tiny_cpu):
    arrivals = workload()
    dense = run_script(make_engine(tiny_cpu, hisparse=False), arrivals)
    engine = make_engine(tiny_cpu, hisparse=True)
    # NaN-poison both pools: any row read before it was written would show up in the logits.
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    stats = engine.stats()
    assert stats.hisparse_misses > 0, "the long path (misses from the host pool) was never exercised"
    assert stats.hisparse_hits > 0
    assert [s.hits + s.misses for s in stats.hisparse_layers] == sparse.selected_per_layer
    assert engine.is_idle_and_empty()


def tight_hisparse_budget(num_buffers: int, indexer_pages: int, row_bytes: int = 576 * 4, layers: int = 3,
                          buffer_size: int = TOP_K, num_recent: int = 2, page: int = 16) -> int:
    """Device bytes that plan_hisparse splits into exactly this many buffers and indexer pages (host budget
    larger than the device one)."""
    return num_buffers * (buffer_size + num_recent) * row_bytes * layers + indexer_pages * 132 * layers * page


def test_hisparse_matches_dense_with_retractions(tiny_cpu):
    """Retracted requests resume from the host pool without recompute; dense replays HiSparse's batches."""
    arrivals = workload(seed=1)
    engine = make_engine(tiny_cpu, hisparse=True, device_budget=tight_hisparse_budget(3, 12),
                         host_budget=64 << 20, optimistic=True)
    assert (engine.kv.layout.num_buffers, engine.kv.layout.indexer_pages) == (3, 12)
    sparse = run_script(engine, arrivals)
    dense = run_script(make_engine(tiny_cpu, hisparse=False), arrivals, replay=sparse.schedule)
    assert_identical(dense, sparse)
    assert engine.stats().num_retractions > 0, "the budget was meant to force retractions"
    assert engine.is_idle_and_empty()


@pytest.mark.gpu
def test_hisparse_matches_dense_on_cuda(tiny_cuda):
    tiny = tiny_cuda
    arrivals = workload()
    dense = run_script(make_engine(tiny, hisparse=False, device="cuda"), arrivals)
    again = run_script(make_engine(tiny, hisparse=False, device="cuda"), arrivals)
    # If this fails, the model itself is not run-to-run deterministic on this GPU (e.g. atomics), and no
    # comparison below can be bit-exact.
    assert_identical(dense, again)
    engine = make_engine(tiny, hisparse=True, device="cuda")
    assert engine.kv.host.pinned
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert engine.stats().hisparse_misses > 0
    # With retractions forced (bf16 rows); dense replays HiSparse's batches.
    engine = make_engine(tiny, hisparse=True, device="cuda", host_budget=64 << 20, optimistic=True,
                         device_budget=tight_hisparse_budget(3, 12, row_bytes=576 * 2))
    sparse = run_script(engine, arrivals)
    dense = run_script(make_engine(tiny, hisparse=False, device="cuda"), arrivals, replay=sparse.schedule)
    assert_identical(dense, sparse)
    assert engine.stats().num_retractions > 0
    assert engine.is_idle_and_empty()


def test_one_token_prefill_chunks_are_not_decode(tiny_cpu):
    """A prefill batch whose chunks are all one token long (chunk budget 1 at the end of prompts) must still go
    through the prefill path: the prompt's rows are only on the host until the buffer is preloaded."""
    gen = torch.Generator().manual_seed(3)
    arrivals = [Arrival(0, "a", random_prompt(gen, 81), 5), Arrival(0, "b", random_prompt(gen, 1), 3)]
    dense = run_script(make_engine(tiny_cpu, hisparse=False, chunk=40), arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, chunk=40)
    sparse = run_script(engine, arrivals)
    # 81 = 40 + 40 + 1: the last chunk of "a" and the whole of "b" make a batch of one-token chunks.
    assert (["a", "b"], [80, 0], [1, 1], False) in sparse.schedule
    assert_identical(dense, sparse)
