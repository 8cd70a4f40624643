"""The speculative prefetch on the GPU (HiSparseConfig.speculative_prefetch, decode_server/hisparse/prefetch.py,
issue 23 item 3): each full layer's top-k is swapped into the next full layer's buffer on the side stream (one
event per bet, waited for by that layer's own swap-in; a fork and join inside CUDA-graph capture too).

tiny-dsa (bf16 rows, Triton attention) and its 64-head variant (FP8 rows, FlashMLA where installed): bets on (with
and without the early swap-in) == bets off == dense, greedy tokens and logits bit for bit, eagerly and with CUDA
graphs (same buckets in every engine), HiSparse pools NaN-poisoned (a row read before its copy landed shows in the
logits); layer 0, which nobody bets on, keeps exactly its counters; the bets hit and copied; nothing pending after
the run.

tiny-glm5 (full, shared, full, shared; bf16 rows), the bets' payoff counterfactual on the CUDA swap-in kernel:
without bets each full layer's counters equal its shared follower's exactly, eagerly and with graphs; with bets
the follower's counters stay those without bets and the payoff of full layer 2 is its follower's misses − its own
(`rows_saved_by_bets`). The figures of the bet against a synthetic cross-layer overlap are benchmarks/bench_decode.py's
(--cross-layer-overlap, docs/benchmarks.md).

Run: pytest -m gpu tests/hisparse/test_speculative_prefetch_gpu.py -v
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_same_run, buffer_sized_workload, run_poisoned_modes

from decode_server.model import Tokenizer, load_model, resolve_model_path

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


@pytest.fixture(scope="module")
def glm5_cuda():
    """tiny-glm5 (full, shared, full, shared) in bf16 on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, config = load_model("tiny-glm5", "cuda", torch.bfloat16, quantization="none")
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-glm5"))


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cuda_graph"])
def test_the_bets_payoff_counterfactual_holds_on_cuda(glm5_cuda, graphs: bool) -> None:
    top_k = int(glm5_cuda[1].index_topk)
    common = {"device": "cuda", "buffer_size": top_k, "max_running": 12, "chunk": 512}
    common.update({"cuda_graph_bs": BUCKETS} if graphs else {"disable_cuda_graph": True})
    modes = [("dense", {"hisparse": False}), ("off", {"hisparse": True, "prefetch_shared_layers": True}),
             ("bets", {"hisparse": True, "prefetch_shared_layers": True, "speculative_prefetch": True})]
    results, engines = run_poisoned_modes(glm5_cuda, buffer_sized_workload(top_k, seed=23), modes, graphs, **common)
    for name in ("off", "bets"):
        assert_same_run(f"HiSparse ({name}) vs dense", results["dense"], results[name])
    off = [(s.hits, s.misses) for s in engines["off"].stats().hisparse_layers]
    assert off[2][1] > 0, off
    assert off[0] == off[1] and off[2] == off[3], f"a full layer and its follower diverged without bets: {off}"
    layers = engines["bets"].stats().hisparse_layers
    assert [(s.hits, s.misses) for s in layers[:2]] + [(layers[3].hits, layers[3].misses)] == off[:2] + [off[3]]
    assert [s.speculative_rows_saved for s in layers] == [None, None, layers[3].misses - layers[2].misses, None]
    assert layers[2].speculative_misses > 0
