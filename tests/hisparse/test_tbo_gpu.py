"""Two-batch overlap (`--enable-two-batch-overlap`) on the GPU: the two micro-batches really run on two CUDA
streams, inside the captured decode graphs too. Per attention kernel (Triton, FlashMLA where the sgl-flash-mla
wheel is present) and KV row format, over workloads whose decode batches go 1 → 10 → 1 (or 48) requests with
swap-in misses every few steps:

(a) HiSparse == dense bit for bit with two-batch overlap and CUDA graphs on in both (tokens, logits), HiSparse
    pools NaN-poisoned; the same with every step eager (`--disable-cuda-graph`: the streams' concurrency is not
    fixed by a graph);
(b) a replayed two-stream step == the same padded two-stream step run eagerly, bit for bit, swap-in counters
    included;
(c) two-batch overlap on == off in greedy tokens, graphs on (logits are not promised equal: the micro-batches'
    GEMMs have half the rows; the largest difference is printed).

Run: pytest -m gpu -p no:cacheprovider -o addopts="" -q tests/hisparse/test_tbo_gpu.py
"""

from __future__ import annotations

import pytest
from harness import RunResult, make_engine, run_script
from test_cuda_graph_gpu import BIG_BUCKETS, BUCKETS, MAX_RUNNING, compare, counters, workload

import kernels.sparse_mla_flashmla as flashmla

pytestmark = pytest.mark.gpu

CASES = [  # (model fixture, attention backend, KV cache dtype, requests)
    ("tiny_cuda", "triton", "auto", 10),
    ("tiny_cuda", "triton", "fp8_e4m3", 10),
    ("wide_cuda", "flashmla", "fp8_e4m3", 10),
    ("wide_cuda", "flashmla", "auto", 48),  # FlashMLA's bf16 kernel from batch 40: micro-batches of 24 use Triton
    ("wide_cuda", "flashmla", "fp8_e4m3", 48),
]


def _setup(request, model: str, backend: str, kv_cache_dtype: str, num: int) -> tuple:
    if backend == "flashmla" and not flashmla.flashmla_available():
        pytest.skip("needs a Hopper GPU and the sgl-flash-mla wheel")
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    buckets = BUCKETS if num <= MAX_RUNNING else BIG_BUCKETS
    common = {"device": "cuda", "buffer_size": top_k, "max_running": max(MAX_RUNNING, num), "chunk": 512,
              "kv_cache_dtype": kv_cache_dtype, "attention_backend": backend}
    return tiny, workload(top_k, num=num), buckets, common


def _run(tiny, arrivals, hisparse: bool, **kwargs) -> tuple[RunResult, object]:
    engine = make_engine(tiny, hisparse=hisparse, **kwargs)
    if hisparse:
        engine.kv.host.kv.fill_(0xFF)  # NaN in every row format: a stale read shows in the logits
        engine.kv.buffers.kv.fill_(0xFF)
    return run_script(engine, arrivals), engine


@pytest.mark.parametrize(("model", "backend", "kv_cache_dtype", "num"), CASES)
def test_tbo_hisparse_matches_dense(request, model: str, backend: str, kv_cache_dtype: str, num: int) -> None:
    """(a) and (b)."""
    tiny, arrivals, buckets, common = _setup(request, model, backend, kv_cache_dtype, num)
    results, engines = {}, {}
    for hisparse in (False, True):
        for how in ("graphs", "padded-eager", "eager"):
            kwargs = {"cuda_graph_bs": buckets} if how == "graphs" else (
                {"eager_graph_buckets": buckets} if how == "padded-eager" else {"disable_cuda_graph": True})
            result, engine = _run(tiny, arrivals, hisparse, two_batch=True, **kwargs, **common)
            assert engine.two_batch is not None and engine.two_batch.stream is not None
            if how == "graphs":
                assert engine.graph_runner is not None, f"graphs were not captured: {engine.cuda_graph_error}"
                assert engine.graph_runner.captured == buckets and engine.graph_runner.num_replays > 20
            else:
                assert engine.two_batch.num_forwards > 20
            assert engine.is_idle_and_empty()
            results[hisparse, how], engines[hisparse, how] = result, engine
    for how in ("graphs", "padded-eager", "eager"):
        compare(f"(a) HiSparse vs dense, two-batch overlap, {how}", results[False, how], results[True, how])
        assert engines[True, how].stats().hisparse_misses > 0, f"(a) {how}: no swap-in miss"
    for hisparse in (False, True):
        compare(f"(b) hisparse={hisparse}: two-stream replay vs the same padded steps eager",
                results[hisparse, "graphs"], results[hisparse, "padded-eager"])
    assert counters(engines[True, "graphs"]) == counters(engines[True, "padded-eager"]), "(b) counters differ"


@pytest.mark.parametrize(("model", "backend", "kv_cache_dtype", "num"), CASES[:1] + CASES[3:4])
def test_tbo_on_off_same_tokens(request, model: str, backend: str, kv_cache_dtype: str, num: int) -> None:
    """(c)."""
    tiny, arrivals, buckets, common = _setup(request, model, backend, kv_cache_dtype, num)
    for hisparse in (False, True):
        off, _ = _run(tiny, arrivals, hisparse, cuda_graph_bs=buckets, **common)
        on, engine = _run(tiny, arrivals, hisparse, cuda_graph_bs=buckets, two_batch=True, **common)
        assert engine.graph_runner is not None and engine.graph_runner.num_replays > 20
        worst = compare(f"(c) hisparse={hisparse}: two-batch overlap on vs off", off, on, exact=False)
        print(f"hisparse={hisparse} {backend} {kv_cache_dtype}: largest logits difference on vs off {worst:.3e}")
