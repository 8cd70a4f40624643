"""Dense mode grows KV page by page and retracts when a page is missing: the retracted request's rows go to host
memory and come back bit for bit (its tokens and logits equal a run with ample memory and the same batches)."""

from __future__ import annotations

from harness import PAGE, assert_identical, make_engine, run_script
from test_lossless import workload

DENSE_ROW = 3 * (576 * 4 + 132)  # device bytes per token of tiny-dsa in float32 (MLA row + indexer key)


def test_dense_retracts_and_resumes_bit_identically(tiny_cpu):
    engine = make_engine(tiny_cpu, hisparse=False, device_budget=12 * PAGE * DENSE_ROW, optimistic=True)
    assert engine.kv.cache.allocator.num_pages == 12
    tight = run_script(engine, workload(seed=1))
    assert engine.stats().num_retractions > 0, "the budget was meant to force retractions"
    assert engine.is_idle_and_empty()
    ample = run_script(make_engine(tiny_cpu, hisparse=False), workload(seed=1), replay=tight.schedule)
    assert_identical(ample, tight)
    assert all(reason == "length" for reason in tight.finish.values())
