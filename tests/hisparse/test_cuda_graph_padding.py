"""The padded, static-buffer decode forward that CUDA graphs capture, run eagerly on CPU (DecodeGraphRunner
without capture): HiSparse == dense bit for bit with it in both modes, padded rows touch no request's memory (only
the scratch row's), and against unpadded steps the tokens agree (logits only up to rounding: padding changes the
GEMM shapes, on CPU as on GPU)."""

from __future__ import annotations

import pytest
import torch
from harness import TOP_K, Arrival, assert_identical, make_engine, random_prompt, run_script

from decode_server.engine.forward_batch import SCRATCH_SLOTS

BUCKETS = [2, 4]  # batches of 3 and 4 run as 4, batches of 5 or 6 run eagerly unpadded
SMALL = {"device_budget": 8 << 20, "host_budget": 16 << 20}  # pools for this workload (fills and copies are cheap)


def workload(seed: int = 0) -> list[Arrival]:
    gen = torch.Generator().manual_seed(seed)
    # Prompts shorter and longer than D = top_k = 64 (fast path, ring, LRU misses); pages of 16 grow in decode;
    # the batch size goes 1 → 6 → 1 as requests join and finish.
    spec = [(0, 20, 10), (0, 90, 12), (1, 70, 6), (3, 40, 8), (3, 100, 5), (4, 56, 12)]
    return [Arrival(step, f"r{i}", random_prompt(gen, n), m) for i, (step, n, m) in enumerate(spec)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_hisparse_matches_dense_with_padded_batches(tiny_cpu, kv_cache_dtype: str) -> None:
    arrivals = workload()
    dense_engine = make_engine(tiny_cpu, hisparse=False, kv_cache_dtype=kv_cache_dtype, eager_graph_buckets=BUCKETS,
                               **SMALL)
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(tiny_cpu, hisparse=True, kv_cache_dtype=kv_cache_dtype, eager_graph_buckets=BUCKETS, **SMALL)
    engine.kv.host.kv.fill_(0xFF)  # NaN in every row format: a stale read shows in the logits
    engine.kv.buffers.kv.fill_(0xFF)
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    for eng in (engine, dense_engine):
        assert eng.graph_runner.num_eager > 0, "no decode step ran padded"
        assert eng.graph_runner.captured == []
    stats = engine.stats()
    assert stats.hisparse_misses > 0
    # Padded rows count no swap-in hit: hits + misses are the real rows' selected entries.
    assert [s.hits + s.misses for s in stats.hisparse_layers] == sparse.selected_per_layer
    assert engine.is_idle_and_empty() and dense_engine.is_idle_and_empty()


def test_padded_steps_match_unpadded_tokens(tiny_cpu) -> None:
    arrivals = workload(seed=2)
    for hisparse in (False, True):
        plain = run_script(make_engine(tiny_cpu, hisparse=hisparse, **SMALL), arrivals)
        padded_engine = make_engine(tiny_cpu, hisparse=hisparse, eager_graph_buckets=BUCKETS, **SMALL)
        padded = run_script(padded_engine, arrivals)
        assert padded_engine.graph_runner.num_eager > 0
        assert padded.tokens == plain.tokens, f"hisparse={hisparse}: greedy tokens differ with padded batches"
        for rid, logits in plain.logits.items():
            for i, (a, b) in enumerate(zip(logits, padded.logits[rid], strict=True)):
                diff = float((a - b).abs().max())
                assert diff < 1e-3, f"hisparse={hisparse} {rid} token {i}: logits differ by {diff} with padding"


def _state(engine) -> dict[str, torch.Tensor]:
    kv = engine.kv
    if engine.config.enable_hisparse:
        return {"device_kv": kv.buffers.kv, "buffer_tokens": kv.buffers.buffer_tokens, "lru": kv.buffers.lru_order,
                "host_kv": kv.host.kv, "index_keys": kv.indexer.keys.view(torch.uint8),
                "index_scales": kv.indexer.scales, "counters": kv.counters.swap}
    return {"kv": kv.cache.kv, "index_keys": kv.cache.index_keys.view(torch.uint8),
            "index_scales": kv.cache.index_scales}


def _allowed(engine, rows: list[int], prefix: list[int]) -> dict[str, tuple[int, list[int]]]:
    """Per state tensor: (dimension, indices) a padded step may write: the real requests' memory and the scratch
    region; everything else must keep its bits."""
    kv = engine.kv
    if engine.config.enable_hisparse:
        bufs = kv.buffers
        n_dev = bufs.num_buffers * bufs.slots_per_buffer
        dev_slots = [int(s) for r in rows for s in bufs.buffer_slots[r].tolist()] + list(range(n_dev, n_dev
                                                                                                   + SCRATCH_SLOTS))
        n_idx = kv.indexer.rows.allocator.num_slots
        idx_rows = [int(kv.indexer.rows.table[r, p]) for r, p in zip(rows, prefix, strict=True)]
        idx_rows += list(range(n_idx, n_idx + SCRATCH_SLOTS))
        host_rows = [int(kv.host.rows.table[r, p]) for r, p in zip(rows, prefix, strict=True)]
        return {"device_kv": (1, dev_slots), "buffer_tokens": (1, rows), "lru": (1, rows), "host_kv": (1, host_rows),
                "index_keys": (1, idx_rows), "index_scales": (1, idx_rows), "counters": (1, [0, 1])}
    cache = kv.cache
    slots = [int(cache.tokens.table[r, p]) for r, p in zip(rows, prefix, strict=True)]
    slots += list(range(cache.scratch_slot, cache.scratch_slot + SCRATCH_SLOTS))
    return {"kv": (1, slots), "index_keys": (1, slots), "index_scales": (1, slots)}


@pytest.mark.parametrize("hisparse", [False, True])
def test_padded_rows_touch_only_scratch_memory(tiny_cpu, hisparse: bool) -> None:
    # Small pools: every state tensor is copied before each step.
    engine = make_engine(tiny_cpu, hisparse=hisparse, eager_graph_buckets=[8], **SMALL)
    runner = engine.graph_runner
    real_run = runner.run
    checked: list[int] = []

    def checking_run(batch, input_ids, bucket=None):
        before = {k: v.clone() for k, v in _state(engine).items()}
        logits = real_run(batch, input_ids, bucket=bucket)
        allowed = _allowed(engine, batch.req_rows_cpu, batch.prefix_lens_cpu)
        for name, after in _state(engine).items():
            dim, idx = allowed[name]
            keep = torch.ones(after.shape[dim], dtype=torch.bool)
            keep[torch.tensor(idx, dtype=torch.long)] = False
            a, b = before[name].index_select(dim, keep.nonzero().squeeze(1)), after.index_select(
                dim, keep.nonzero().squeeze(1))
            assert torch.equal(a, b), f"step {len(checked)}: a padded step wrote {name} outside the real requests"
        checked.append(batch.batch_size)
        return logits

    runner.run = checking_run
    if hisparse:
        engine.kv.host.kv.fill_(0xFF)
        engine.kv.buffers.kv.fill_(0xFF)
    result = run_script(engine, workload(seed=3))
    assert len(checked) > 8 and min(checked) < 8, f"decode batch sizes seen: {checked}"
    assert not any(t.isnan().any() for logits in result.logits.values() for t in logits)
    if hisparse:
        assert engine.stats().hisparse_misses > 0
        stats = engine.stats().hisparse_layers
        assert [s.hits + s.misses for s in stats] == result.selected_per_layer
    assert engine.is_idle_and_empty()
    assert TOP_K == 64
