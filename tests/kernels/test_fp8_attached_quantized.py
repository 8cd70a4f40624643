"""A producer's block-FP8 form of its output, handed to the FP8 GEMM after it (kernels/fp8_gemm.py
`attach_quantized`, `reads_quantized_input`; the RMSNorm that writes it: kernels/norm_rope_triton.py, checked under
the interpreter by triton_cpu_checks.py `interpret-norm-quant`, and on the GPU by test_fused_ops_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8_gemm
from kernels.fp8_gemm import GemmChoice, attach_quantized, attached_quantized, reads_quantized_input


def _form(rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(rows, k, dtype=torch.float8_e4m3fn), torch.ones((k + 127) // 128, rows)


def test_attached_form_lives_on_the_tensor_and_dies_with_an_in_place_write() -> None:
    x = torch.randn(3, 256)
    q, scales = _form(3, 256)
    assert attached_quantized(x) is None
    assert attach_quantized(x, q, scales) is x
    got = attached_quantized(x)
    assert got is not None and got[0] is q and got[1] is scales
    assert attached_quantized(x.view(3, 256)) is None  # a view is another tensor: the GEMM quantizes it itself
    assert attached_quantized(x.clone()) is None
    x.add_(1)  # written after its producer quantized it: the form no longer describes it
    assert attached_quantized(x) is None


def test_inference_tensors_carry_the_form_without_a_version_counter() -> None:
    """The engine runs under inference mode, where tensors count no versions: the form is still attached and
    read (the producer's contract: a fresh output, not written before its GEMM)."""
    with torch.inference_mode():
        x = torch.randn(2, 128)
        q, scales = _form(2, 128)
        attach_quantized(x, q, scales)
        got = attached_quantized(x)
        assert got is not None and got[0] is q
    assert attached_quantized(x) is not None


@pytest.mark.parametrize("q_shape, s_shape", [((3, 128), (2, 3)), ((2, 256), (2, 3)), ((3, 256), (3, 2))])
def test_attaching_a_form_of_another_shape_is_refused(q_shape: tuple[int, int], s_shape: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        attach_quantized(torch.randn(3, 256), torch.zeros(q_shape, dtype=torch.float8_e4m3fn), torch.ones(s_shape))
    with pytest.raises(ValueError, match="does not fit"):
        attach_quantized(torch.randn(1, 3, 256), *_form(3, 256))


def test_reads_quantized_input_follows_the_tuners_choice() -> None:
    """True only for a decided Triton kernel that reads quantized activations, at the row count's bucket."""
    from kernels.fp8_gemm_triton import TritonGemmConfig  # noqa: PLC0415 — triton: the test extra

    cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
    tuner = fp8_gemm.reset_tuner("table")
    try:
        assert not reads_quantized_input(2240, 7168, 1, torch.bfloat16, cuda)  # not decided yet
        assert not reads_quantized_input(2240, 7168, 1, torch.bfloat16, torch.device("cpu"))

        def decide(bucket: int, choice: GemmChoice) -> None:
            tuner._choices[("dense", 2240, 7168, 0, bucket, torch.bfloat16, 0, (128, 128))] = choice

        decide(1, GemmChoice("triton", TritonGemmConfig(block_n=16, gemv_groups=4, gemv_stages=3)))
        decide(8, GemmChoice("triton", TritonGemmConfig(block_n=16, gemv_groups=4, fuse_quant=True)))
        decide(64, GemmChoice("scaled_mm"))
        assert reads_quantized_input(2240, 7168, 1, torch.bfloat16, cuda)
        assert not reads_quantized_input(2240, 7168, 2, torch.bfloat16, cuda)  # bucket 2: not decided
        assert not reads_quantized_input(2240, 7168, 5, torch.bfloat16, cuda)  # quantizes inside
        assert not reads_quantized_input(2240, 7168, 40, torch.bfloat16, cuda)  # scaled_mm pads rows itself
        assert not reads_quantized_input(2240, 7168, 1, torch.float16, cuda)
        assert not reads_quantized_input(2240, 7168, 1, torch.bfloat16, torch.device("cuda", 1))
    finally:
        fp8_gemm.reset_tuner()


def test_layers_name_the_fp8_gemm_that_reads_their_input() -> None:
    """The norms before attention and the MLP ask about the right GEMM: the stacked q_a / wk / kv_a and the
    stacked gate / up (shared experts in a MoE layer); None without FP8 weights."""
    from decode_server.model import build_random_model, load_config

    cfg = load_config("tiny-dsa")
    fp8 = build_random_model(cfg, torch.device("cpu"), torch.float32, quantization="fp8")
    for layer in fp8.model.layers:
        attn = layer.self_attn
        shape = attn.fp8_input_shape()
        assert shape == tuple(attn.fused_inputs.stacked["weight"].shape)
        assert shape[1] == cfg.hidden_size
        assert shape[0] == sum(p.weight.shape[0] for p in attn.input_projections())
        mlp_shape = layer.mlp.fp8_input_shape()
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
        assert mlp_shape == tuple(mlp.fused_gate_up.stacked["weight"].shape)
        assert mlp_shape == (2 * mlp.gate_proj.weight.shape[0], cfg.hidden_size)
    plain = build_random_model(cfg, torch.device("cpu"), torch.float32, quantization="none")
    assert all(layer.self_attn.fp8_input_shape() is None and layer.mlp.fp8_input_shape() is None
               for layer in plain.model.layers)
