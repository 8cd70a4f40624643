"""FP8 KV (FlashMLA's 656 B rows): HiSparse must still be bit-identical to dense, since both store the same
packed bytes and the attention reads the same rows in the same order; mirrors test_lossless.py."""

from __future__ import annotations

import pytest
import torch
from harness import TOP_K, Arrival, assert_identical, make_engine, random_prompt, run_script
from test_lossless import tight_hisparse_budget, workload

FP8 = "fp8_e4m3"


def fp8_workload(seed: int = 0) -> list[Arrival]:
    gen = torch.Generator().manual_seed(seed)
    # Smaller than test_lossless's (FP8 unpacking makes the CPU reference slower) but every path is there:
    # prompts shorter and longer than the buffer (D = top_k = 64), a 2-chunk prefill (100 tokens), a request
    # crossing D during decode (56 + 12), requests joining at later steps.
    spec = [(0, 20, 4), (0, 100, 8), (2, 80, 10), (4, 56, 12)]
    return [Arrival(step, f"r{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


def test_fp8_hisparse_matches_dense_bit_for_bit(tiny_cpu):
    arrivals = fp8_workload()
    dense_engine = make_engine(tiny_cpu, hisparse=False, kv_cache_dtype=FP8)
    assert dense_engine.kv.cache.kv.dtype == torch.uint8 and dense_engine.kv.cache.kv.shape[-1] == 656
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, kv_cache_dtype=FP8)
    assert engine.kv.layout.row_bytes == 656 and engine.kv.layout.buffer_size == TOP_K
    # 0xFF is NaN in e4m3 and in the fp32 scales: any row read before it was written shows up in the logits.
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert not any(t.isnan().any() for logits in sparse.logits.values() for t in logits)
    stats = engine.stats()
    assert stats.hisparse_misses > 0, "the long path (misses from the host pool) was never exercised"
    assert stats.hisparse_hits > 0
    assert [s.hits + s.misses for s in stats.hisparse_layers] == sparse.selected_per_layer
    assert engine.is_idle_and_empty() and dense_engine.is_idle_and_empty()


@pytest.mark.gpu
def test_fp8_hisparse_matches_dense_on_cuda(tiny_cuda):
    tiny = tiny_cuda
    arrivals = fp8_workload()
    dense = run_script(make_engine(tiny, hisparse=False, device="cuda", kv_cache_dtype=FP8), arrivals)
    again = run_script(make_engine(tiny, hisparse=False, device="cuda", kv_cache_dtype=FP8), arrivals)
    # If this fails, the model itself is not run-to-run deterministic on this GPU, and nothing below can be.
    assert_identical(dense, again)
    engine = make_engine(tiny, hisparse=True, device="cuda", kv_cache_dtype=FP8)
    assert engine.kv.host.pinned and engine.kv.layout.row_bytes == 656
    engine.kv.host.kv.fill_(0xFF)
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert engine.stats().hisparse_misses > 0
    # With retractions forced (656 B rows; test_lossless's larger workload); dense replays HiSparse's batches.
    engine = make_engine(tiny, hisparse=True, device="cuda", kv_cache_dtype=FP8, host_budget=64 << 20,
                         optimistic=True,
                         device_budget=tight_hisparse_budget(3, 12, row_bytes=656))
    assert (engine.kv.layout.num_buffers, engine.kv.layout.indexer_pages) == (3, 12)
    sparse = run_script(engine, workload(seed=1))
    dense = run_script(make_engine(tiny, hisparse=False, device="cuda", kv_cache_dtype=FP8), workload(seed=1),
                       replay=sparse.schedule)
    assert_identical(dense, sparse)
    assert engine.stats().num_retractions > 0
    assert engine.is_idle_and_empty()
