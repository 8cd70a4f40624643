"""The early swap-in on the GPU (HiSparseConfig.early_swap_in, decode_server/hisparse/prefetch.py, issue 23
item 4): each layer's swap-in runs on a high-priority side stream from its prepare_attention, beside the query
and KV-row projections, joined by an event before its attention (a fork and join inside CUDA-graph capture too).

tiny-dsa (bf16 rows, Triton attention) and its 64-head variant (FP8 rows, FlashMLA where installed): early on ==
early off == dense, greedy tokens and logits bit for bit, eagerly and with CUDA graphs (same buckets in every
engine), HiSparse pools NaN-poisoned (a row read before its copy landed shows in the logits), misses in every
layer, swap counters equal; nothing pending after the run.

Run: pytest -m gpu tests/hisparse/test_early_swap_in_gpu.py -v
"""

from __future__ import annotations

import pytest
from harness import assert_same_run, buffer_sized_workload, run_poisoned_modes

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize(("model", "kv_dtype"), [("tiny_cuda", "auto"), ("wide_cuda", "fp8_e4m3")])
def test_early_swap_in_is_bit_identical_on_cuda(request, model: str, kv_dtype: str, graphs: bool) -> None:
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    common = {"device": "cuda", "buffer_size": top_k, "max_running": 12, "chunk": 512, "kv_cache_dtype": kv_dtype}
    common.update({"cuda_graph_bs": BUCKETS} if graphs else {"disable_cuda_graph": True})
    modes = [("dense", {"hisparse": False, "early_swap_in": True}),
             ("late", {"hisparse": True, "early_swap_in": False}), ("early", {"hisparse": True, "early_swap_in": True})]
    results, engines = run_poisoned_modes(tiny, buffer_sized_workload(top_k, seed=13), modes, graphs, **common)
    assert_same_run("HiSparse, late swap-in, vs dense", results["dense"], results["late"])
    assert_same_run("HiSparse, early swap-in, vs dense", results["dense"], results["early"])
    counters = [(s.hits, s.misses) for s in engines["early"].stats().hisparse_layers]
    assert counters == [(s.hits, s.misses) for s in engines["late"].stats().hisparse_layers]
    assert all(misses > 0 for _, misses in counters), counters
    prefetch = engines["early"].kv.backend.prefetch
    assert prefetch.stream is not None and prefetch.early_launched > 0 and prefetch.pending_layers == ()
    assert engines["late"].kv.backend.prefetch.stream is None
    if graphs:
        assert engines["early"].graph_runner.num_replays > 10
    for engine in engines.values():
        assert engine.is_idle_and_empty()
