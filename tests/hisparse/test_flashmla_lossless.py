"""HiSparse == dense bit for bit within each attention backend (FlashMLA and Triton), bf16 and FP8 KV, on a
64-head variant of tiny-dsa (FlashMLA takes 64 or 128 heads) with top-k 128, and enough concurrent requests that
FlashMLA runs in decode for both row formats (its bf16 kernel only from a batch of FLASHMLA_MIN_BATCH on)."""

from __future__ import annotations

import pytest
import torch
from harness import Arrival, assert_identical, make_engine, random_prompt, run_script

import kernels.sparse_mla_flashmla as flashmla
from kernels.sparse_mla_plan import FLASHMLA_MIN_BATCH

pytestmark = pytest.mark.gpu

TOP_K = 128  # the wide_cuda model's index_topk (conftest.py)
NUM_REQUESTS = 30


def workload() -> list[Arrival]:
    gen = torch.Generator().manual_seed(4)
    # Prompts longer than top-k and than the buffer (D = 128), so selection is sparse and misses happen.
    return [Arrival(i % 3, f"r{i}", random_prompt(gen, 150 + 7 * i), 6 + i % 4) for i in range(NUM_REQUESTS)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("backend", ["flashmla", "triton"])
def test_hisparse_matches_dense_per_backend(wide_cuda, backend: str, kv_cache_dtype: str, monkeypatch) -> None:
    if backend == "flashmla" and not flashmla.flashmla_available():
        pytest.skip("needs a Hopper GPU and the sgl-flash-mla wheel")
    batches: list[int] = []
    real = flashmla.sparse_mla_decode_flashmla

    def counting(q, kv, indices, scale):
        batches.append(int(q.shape[0]))
        return real(q, kv, indices, scale)

    monkeypatch.setattr(flashmla, "sparse_mla_decode_flashmla", counting)
    arrivals = workload()
    common = {"device": "cuda", "buffer_size": TOP_K, "max_running": NUM_REQUESTS, "chunk": 512,
              "kv_cache_dtype": kv_cache_dtype, "attention_backend": backend}
    dense_engine = make_engine(wide_cuda, hisparse=False, **common)
    assert dense_engine.attention_kernel == backend
    dense = run_script(dense_engine, arrivals)
    engine = make_engine(wide_cuda, hisparse=True, **common)
    engine.kv.buffers.kv.fill_(0xFF)  # NaN in bf16, e4m3 and the FP8 row's scales: a stale read shows
    sparse = run_script(engine, arrivals)
    assert_identical(dense, sparse)
    assert not any(t.isnan().any() for logits in sparse.logits.values() for t in logits)
    assert engine.stats().hisparse_misses > 0
    assert engine.is_idle_and_empty() and dense_engine.is_idle_and_empty()
    if backend == "flashmla":
        threshold = FLASHMLA_MIN_BATCH[(64, kv_cache_dtype == "fp8_e4m3")]
        assert any(b >= threshold for b in batches), f"FlashMLA never ran a decode batch (calls: {batches})"
    else:
        assert not batches
