"""The speculative prefetch on the GPU (HiSparseConfig.speculative_prefetch, decode_server/hisparse/prefetch.py,
issue 23 item 3): each full layer's top-k is swapped into the next full layer's buffer on the side stream (one
event per bet, waited for by that layer's own swap-in; a fork and join inside CUDA-graph capture too).

tiny-dsa (bf16 rows, Triton attention) and its 64-head variant (FP8 rows, FlashMLA where installed): bets on (with
and without the early swap-in) == bets off == dense, greedy tokens and logits bit for bit, eagerly and with CUDA
graphs (same buckets in every engine), HiSparse pools NaN-poisoned (a row read before its copy landed shows in the
logits); layer 0, which nobody bets on, keeps exactly its counters; the bets hit and copied; nothing pending after
the run. The figures of the bet against a synthetic cross-layer overlap are benchmarks/bench_decode.py's
(--cross-layer-overlap, docs/benchmarks.md).

Run: pytest -m gpu tests/hisparse/test_speculative_prefetch_gpu.py -v
"""

from __future__ import annotations

import pytest
from harness import assert_same_run, buffer_sized_workload, run_poisoned_modes

pytestmark = pytest.mark.gpu

BUCKETS = [1, 2, 4, 8]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize(("model", "kv_dtype"), [("tiny_cuda", "auto"), ("wide_cuda", "fp8_e4m3")])
def test_bets_are_bit_identical_on_cuda(request, model: str, kv_dtype: str, graphs: bool) -> None:
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    common = {"device": "cuda", "buffer_size": top_k, "max_running": 12, "chunk": 512, "kv_cache_dtype": kv_dtype}
    common.update({"cuda_graph_bs": BUCKETS} if graphs else {"disable_cuda_graph": True})
    modes = [("dense", {"hisparse": False}), ("off", {"hisparse": True}),
             ("bets", {"hisparse": True, "speculative_prefetch": True}),
             ("bets+early", {"hisparse": True, "speculative_prefetch": True, "early_swap_in": True})]
    results, engines = run_poisoned_modes(tiny, buffer_sized_workload(top_k, seed=17), modes, graphs, **common)
    for name in ("off", "bets", "bets+early"):
        assert_same_run(f"HiSparse ({name}) vs dense", results["dense"], results[name])
    off = [(s.hits, s.misses) for s in engines["off"].stats().hisparse_layers]
    assert all(misses > 0 for _, misses in off), off
    for name in ("bets", "bets+early"):
        layers = engines[name].stats().hisparse_layers
        assert (layers[0].hits, layers[0].misses) == off[0], f"{name}: layer 0 receives no bet"
        assert all(s.speculative_hits > 0 and s.speculative_misses > 0 for s in layers[1:]), layers
        prefetch = engines[name].kv.backend.prefetch
        assert prefetch.stream is not None and prefetch.speculative_launched > 0
        assert prefetch.pending_bets == () and prefetch.pending_layers == ()
        if graphs:
            assert engines[name].graph_runner.num_replays > 10
    for engine in engines.values():
        assert engine.is_idle_and_empty()
