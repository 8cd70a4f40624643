"""Pools and counters add up: after many random requests, with aborts and retractions, every pool is empty and
hits + misses equals the number of top-k entries the indexer selected in decode steps."""

from __future__ import annotations

import random

import torch
from harness import Arrival, make_engine, random_prompt, run_script
from test_lossless import tight_hisparse_budget


def random_workload(seed: int, num: int = 12) -> list[Arrival]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    arrivals = []
    for i in range(num):
        step = rng.randrange(0, 20)
        abort = step + rng.randrange(0, 12) if rng.random() < 0.3 else None
        arrivals.append(Arrival(step, f"q{i}", random_prompt(gen, rng.randrange(5, 110)), rng.randrange(1, 12), abort))
    # Distinct abort steps (the harness aborts one request per step).
    seen: set[int] = set()
    for a in arrivals:
        while a.abort_at_step is not None and a.abort_at_step in seen:
            a.abort_at_step += 1
        if a.abort_at_step is not None:
            seen.add(a.abort_at_step)
    return arrivals


def test_pools_empty_and_counters_consistent(tiny_cpu):
    engine = make_engine(tiny_cpu, hisparse=True, device_budget=tight_hisparse_budget(3, 10),
                         host_budget=64 << 20, optimistic=True, max_running=5, chunk=96)
    assert (engine.kv.layout.num_buffers, engine.kv.layout.indexer_pages) == (3, 10)
    arrivals = random_workload(seed=8)
    result = run_script(engine, arrivals)
    stats = engine.stats()
    assert stats.num_retractions > 0
    assert engine.is_idle_and_empty()
    for usage in (stats.host_pages, stats.device_slots, stats.indexer_slots):
        assert usage.used == 0 and usage.total > 0
    assert [s.hits + s.misses for s in stats.hisparse_layers] == result.selected_per_layer
    assert all(s.misses > 0 for s in stats.hisparse_layers)
    row = engine.kv.layout.row_bytes
    for s in stats.hisparse_layers:
        assert s.bytes_h2d >= s.misses * row and s.bytes_d2h > 0
    aborted = {a.rid for a in arrivals if a.abort_at_step is not None}
    for a in arrivals:
        reason = result.finish[a.rid]
        if a.rid not in aborted:
            assert reason == "length" and len(result.tokens[a.rid]) == a.max_tokens
        else:
            assert reason in ("abort", "length")
    assert any(result.finish[r] == "abort" for r in aborted)
