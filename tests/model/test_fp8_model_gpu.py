"""The whole model with block-FP8 weights on the GPU, against the same weights dequantized to bf16.

configs/dsv32-bench (DeepSeek-V3.2's layer sizes, 4 layers, full vocabulary) with random FP8 weights drawn on the
device; its bf16 twin is `dequantized_copy` (the `--quantization none` model of the same checkpoint). Over random
prompts (dense attention at 512 tokens, and one of 2304 tokens whose last 256 positions attend the indexer's
top-2048), every position's logits are compared:
  - FP8 model (the GEMM kernels the autotuner picked) vs the same FP8 model with the PyTorch reference GEMMs
    (float32, the same activation rounding): the kernels' own error through the whole model;
  - FP8 model vs the bf16 model: what FP8 activations cost (weights are identical), the figure docs/model.md records.
Printed as `FP8-MODEL ...` lines (the GPU suite collects them); written to $FP8_RESULTS_DIR/fp8_model_accuracy.json
when that is set.

Run: pytest -m gpu tests/model/test_fp8_model_gpu.py -v -s
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from dsa_test_helpers import dense_backend, forward_tokens

import decode_server.model.batch_invariant as batch_invariant
import decode_server.model.moe as moe
from decode_server.model import build_random_model, load_config
from decode_server.model.construct import dequantized_copy
from decode_server.model.weights import weight_bytes
from kernels.fp8_gemm_ref import fp8_grouped_ref, fp8_linear_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [512] * 4 + [2304]


@pytest.fixture(scope="module")
def models():
    config = load_config("dsv32-bench")
    torch.cuda.synchronize()
    start = time.perf_counter()
    fp8 = build_random_model(config, "cuda", torch.bfloat16, seed=0, quantization="fp8")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    bf16 = dequantized_copy(fp8)
    return config, fp8, bf16, seconds


def logits_of(model, config, prompt: list[int], first_layer: list | None = None) -> torch.Tensor:
    """The prompt's logits; `first_layer` receives layer 0's output (float32)."""
    backend = dense_backend(config, num_slots=4096, max_requests=2, max_context=4096, kv_dtype=torch.bfloat16,
                            device="cuda")
    backend.reserve(0, len(prompt))
    hook = None
    if first_layer is not None:
        hook = model.model.layers[0].register_forward_hook(lambda mod, args, out: first_layer.append(out[0].float()))
    try:
        return model.compute_logits(forward_tokens(model, backend, [0], [0], [prompt]))
    finally:
        if hook is not None:
            hook.remove()


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    diff = (a - b).abs()
    return {"positions": a.shape[0], "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
            "max_abs_logit_error": float(diff.max()), "mean_abs_logit_error": float(diff.mean()),
            "max_error_over_max_logit": float(diff.max() / b.abs().max())}


def merge(parts: list[dict]) -> dict:
    n = sum(p["positions"] for p in parts)
    return {"positions": n,
            "top1_agreement": sum(p["top1_agreement"] * p["positions"] for p in parts) / n,
            "max_abs_logit_error": max(p["max_abs_logit_error"] for p in parts),
            "mean_abs_logit_error": sum(p["mean_abs_logit_error"] * p["positions"] for p in parts) / n,
            "max_error_over_max_logit": max(p["max_error_over_max_logit"] for p in parts)}


def reference_gemms(monkeypatch) -> None:
    """Route the model's FP8 layers to the float32 references (same activation rounding) on the GPU."""
    def dense(x, w, s, bias=None, block=(128, 128)):
        rows = x.reshape(-1, x.shape[-1])
        out = fp8_linear_ref(rows, w, s, block).to(x.dtype)
        return (out if bias is None else out + bias).reshape(*x.shape[:-1], w.shape[0])

    def grouped(x, w, s, ends, block=(128, 128), shared=None):
        return fp8_grouped_ref(x, w, s, ends, block).to(x.dtype)

    monkeypatch.setattr(batch_invariant, "_fp8_linear", dense)
    monkeypatch.setattr(moe, "fp8_grouped_linear", grouped)


def test_fp8_model_against_its_references_and_bf16(models, monkeypatch) -> None:
    config, fp8, bf16, build_seconds = models
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, config.vocab_size, (n,), generator=gen).tolist() for n in PROMPTS]
    torch.backends.cuda.matmul.allow_tf32 = False
    kernel_vs_bf16, kernel_vs_ref = [], []
    layer0 = {"fp8_kernels_vs_fp8_reference": 0.0, "fp8_vs_bf16": 0.0}
    for prompt in prompts:
        firsts: list[torch.Tensor] = []
        with torch.inference_mode():
            kernels = logits_of(fp8, config, prompt, firsts)
            dequantized = logits_of(bf16, config, prompt, firsts)
            with monkeypatch.context() as patch:
                reference_gemms(patch)
                emulated = logits_of(fp8, config, prompt, firsts)
        kernel_vs_bf16.append(compare(kernels, dequantized))
        kernel_vs_ref.append(compare(kernels, emulated))
        if len(prompt) <= config.index_topk:  # layer 0 attends densely: no discrete choice before its output
            layer0["fp8_kernels_vs_fp8_reference"] = max(layer0["fp8_kernels_vs_fp8_reference"],
                                                         relative_error(firsts[0], firsts[2]))
            layer0["fp8_vs_bf16"] = max(layer0["fp8_vs_bf16"], relative_error(firsts[0], firsts[1]))
        del kernels, dequantized, emulated, firsts
    results = {"config": "dsv32-bench", "device": torch.cuda.get_device_name(), "prompts": PROMPTS,
               "fp8_build_seconds": build_seconds, "weights_bytes_fp8": weight_bytes(fp8),
               "weights_bytes_bf16": weight_bytes(bf16), "fp8_kernels_vs_fp8_reference": merge(kernel_vs_ref),
               "fp8_vs_bf16": merge(kernel_vs_bf16), "layer0_relative_error": layer0}
    for key in ("fp8_kernels_vs_fp8_reference", "fp8_vs_bf16"):
        r = results[key]
        print(f"\nFP8-MODEL {key}: top-1 agreement {r['top1_agreement']:.4f} over {r['positions']} positions, max "
              f"|Δlogit| {r['max_abs_logit_error']:.4f} (mean {r['mean_abs_logit_error']:.5f}, max/max|logit| "
              f"{r['max_error_over_max_logit']:.4f})")
    print(f"FP8-MODEL layer 0 output, relative error (Frobenius, prompts attended densely): kernels vs reference "
          f"{layer0['fp8_kernels_vs_fp8_reference']:.2e}, FP8 vs bf16 {layer0['fp8_vs_bf16']:.2e}")
    print(f"FP8-MODEL weights: FP8 {results['weights_bytes_fp8']['total'] / 2**30:.2f} GiB vs bf16 "
          f"{results['weights_bytes_bf16']['total'] / 2**30:.2f} GiB; FP8 model built in {build_seconds:.1f} s")
    out_dir = os.environ.get("FP8_RESULTS_DIR")
    if out_dir:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "fp8_model_accuracy.json").write_text(json.dumps(results, indent=2))
    # Layer 0 (dense MLA, the indexer, the dense MLP: no discrete choice at 512 tokens) holds the kernels to their
    # arithmetic: a scale or indexing bug would put it O(1) away from the references. Not to bf16 noise, though:
    # each FP8 GEMM re-quantizes its input per 128-channel group, so a 1-ulp difference in a bf16 input can move an
    # element across an e4m3 rounding boundary (2^-4 of it) or change its group's scale, and chained projections
    # (q_a → q_b, o_proj, MLP up → down) carry that on. Measured on an H100 (2026-11-25): kernels vs the float32
    # reference GEMMs 2.4e-2, FP8 vs the bf16 model 3.8e-2; bounds 2^-4 and 2^-3 (the per-element rounding scale).
    # Through the MoE layers a random model is chaotic: its router scores are near-ties, so such differences change
    # which experts a token takes, and the logits then differ by O(1) at many positions (the same run: top-1
    # agreement 0.60 between kernels and reference, 0.59 against bf16, although every GEMM passed its own
    # tolerance in tests/kernels). So the logits are recorded, and held only above chance level (1 / vocabulary).
    assert layer0["fp8_kernels_vs_fp8_reference"] <= 2.0**-4, layer0
    assert layer0["fp8_vs_bf16"] <= 2.0**-3, layer0
    assert results["fp8_kernels_vs_fp8_reference"]["top1_agreement"] >= 0.3
    assert results["fp8_vs_bf16"]["top1_agreement"] >= 0.3
    assert build_seconds < 60
