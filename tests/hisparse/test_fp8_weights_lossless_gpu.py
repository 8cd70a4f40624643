"""HiSparse == dense bit for bit with block-FP8 weights (FP8 GEMMs), CUDA graphs and overlap scheduling on — the
contract of tests/hisparse/test_cuda_graph_gpu.py, now with the model's projections in FP8:

(a) a replayed step == the same padded step run eagerly, bit for bit (the GEMM backend of a shape is fixed per
    process, so replay and eager run the same kernels);
(b) HiSparse == dense, tokens and logits bit for bit, graphs and overlap on in both (HiSparse pools NaN-poisoned).

Models: tiny-dsa loaded from its FP8 checkpoint (Triton GEMMs: its K of 256 does not suit cuBLAS's block scaling)
and a random FP8 model with 64 heads and 512-wide hidden and latent sizes, where torch._scaled_mm applies to
several projections; with the backends forced one at a time and as the autotuner picks them; and the wide model
with its query projections stacked and its shared expert fused into the routed experts' grouped GEMMs.

Run: pytest -m gpu tests/hisparse/test_fp8_weights_lossless_gpu.py -v -s
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import make_engine, run_script
from test_cuda_graph_gpu import BUCKETS, MAX_RUNNING, compare, counters, workload

from decode_server.model import Tokenizer, build_random_model, load_config, load_model, resolve_model_path
from kernels import fp8_gemm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def tiny_fp8_cuda():
    model, config = load_model("tiny-dsa", "cuda", torch.bfloat16, quantization="fp8")
    assert model.quantization == "fp8"
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture(scope="module")
def wide_fp8_cuda():
    config = dataclasses.replace(load_config("tiny-dsa"), hidden_size=512, q_lora_rank=512, intermediate_size=1024,
                                 moe_intermediate_size=256, num_attention_heads=64, num_key_value_heads=64,
                                 index_topk=128)
    model = build_random_model(config, "cuda", torch.bfloat16, seed=11, quantization="fp8")
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


@pytest.fixture(scope="module")
def wide_fp8_fused_cuda():
    """The wide model built as on a GPU whose table has its stacked shapes (the tuner's measure mode at
    construction): q_b + the indexer's wq_b as one GEMM and the shared expert fused into the routed experts'
    grouped GEMMs (decode_server/model/moe.py), the path the shipped tables give DeepSeek-V3.2 and GLM-5."""
    from decode_server.model.moe import MoE

    config = dataclasses.replace(load_config("tiny-dsa"), hidden_size=512, q_lora_rank=512, intermediate_size=1024,
                                 moe_intermediate_size=256, num_attention_heads=64, num_key_value_heads=64,
                                 index_topk=128)
    fp8_gemm.reset_tuner("measure")
    try:
        model = build_random_model(config, "cuda", torch.bfloat16, seed=11, quantization="fp8")
    finally:
        fp8_gemm.reset_tuner()
    assert all(m.fuses_shared for m in model.modules() if isinstance(m, MoE))
    assert all(attn.fused_queries is not None for attn in model.attention_layers() if attn.indexer is not None)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-dsa"))


CASES = [  # (model fixture, FP8 GEMM backend restriction, KV cache dtype)
    ("tiny_fp8_cuda", "auto", "auto"),
    ("wide_fp8_fused_cuda", "auto", "fp8_e4m3"),
    ("wide_fp8_cuda", "auto", "fp8_e4m3"),
    ("wide_fp8_cuda", "scaled_mm", "auto"),
    ("wide_fp8_cuda", "triton", "auto"),
]


@pytest.mark.parametrize(("model", "backend", "kv_cache_dtype"), CASES)
def test_fp8_weights_hisparse_equals_dense_with_graphs_and_overlap(request, model: str, backend: str,
                                                                    kv_cache_dtype: str) -> None:
    tiny = request.getfixturevalue(model)
    top_k = int(tiny[1].index_topk)
    arrivals = workload(top_k)
    common = {"device": "cuda", "buffer_size": top_k, "max_running": MAX_RUNNING, "chunk": 512,
              "kv_cache_dtype": kv_cache_dtype, "attention_backend": "triton"}
    tuner = fp8_gemm.reset_tuner()  # decide the backends under this case's restriction
    results, engines = {}, {}
    with fp8_gemm.force_backend(backend):
        for hisparse in (False, True):
            for graphs in (True, False):
                if graphs:
                    engine = make_engine(tiny, hisparse=hisparse, cuda_graph_bs=BUCKETS, **common)
                    assert engine.graph_runner is not None, f"graphs were not captured: {engine.cuda_graph_error}"
                else:
                    engine = make_engine(tiny, hisparse=hisparse, eager_graph_buckets=BUCKETS, **common)
                assert engine.overlap, "overlap scheduling is on by default on CUDA"
                assert engine.quantization == "fp8" and engine.stats().weights_bytes_by_kind["fp8"] > 0
                if hisparse:
                    engine.kv.host.kv.fill_(0xFF)  # NaN in every row format: a stale read shows in the logits
                    engine.kv.buffers.kv.fill_(0xFF)
                results[hisparse, graphs] = run_script(engine, arrivals)
                engines[hisparse, graphs] = engine
    backends = {r.choice.backend for r in tuner.records}
    print(f"\n{model} {backend} {kv_cache_dtype}: {len(tuner.records)} FP8 GEMM decisions, backends {backends}; "
          + "; ".join(f"{r.kind} N={r.n} K={r.k} M≤{r.bucket}: {r.choice.label()}" for r in tuner.records[:6]))
    assert tuner.records, "the engines ran no FP8 GEMM warm-up"
    if backend == "triton":
        assert backends == {"triton"}
    if backend == "scaled_mm":
        assert "scaled_mm" in backends or any(r.rejected for r in tuner.records), backends
    for hisparse in (False, True):
        mode = "HiSparse" if hisparse else "dense"
        compare(f"(a) {mode}: graph replay vs the same padded step eager", results[hisparse, True],
                results[hisparse, False])
        assert engines[hisparse, True].graph_runner.num_replays > 20
    assert counters(engines[True, True]) == counters(engines[True, False]), "(a) swap-in counters differ"
    compare("(b) HiSparse vs dense, FP8 weights, graphs and overlap on", results[False, True], results[True, True])
    assert engines[True, True].stats().hisparse_misses > 0, "(b) no swap-in miss: the long path was not exercised"
    for engine in engines.values():
        assert engine.is_idle_and_empty()
