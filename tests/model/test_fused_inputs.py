"""MLA's input projections as one GEMM (decode_server/model/fused_linear.py): q_a, the indexer's wk and kv_a share
one stacked weight that their parameters are views of, built at construction and filled by the loader in place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dsa_test_helpers import small_config_dict, small_model
from test_loader import write_checkpoint
from torch import nn

from decode_server.model.batch_invariant import Linear
from decode_server.model.fused_linear import FusedLinear, can_fuse
from decode_server.model.loader import load_checkpoint
from decode_server.model.weights import weight_bytes


def _fp8_linear(in_features: int, out_features: int, seed: int, bias: bool = False) -> Linear:
    from decode_server.model.fp8 import quantize_block_fp8

    gen = torch.Generator().manual_seed(seed)
    lin = Linear(in_features, out_features, bias=bias)
    full = torch.randn(out_features, in_features, generator=gen)
    lin.use_fp8_storage()
    weight, scale = quantize_block_fp8(full)
    lin.weight.data.copy_(weight)
    lin.weight_scale_inv.data.copy_(scale)
    return lin


def _stack_views(attn) -> list[nn.Parameter]:
    return [proj.weight for proj in attn.input_projections()]


def test_construction_stacks_q_a_wk_kv_a() -> None:
    model = small_model(torch.float32, seed=1)
    for attn in model.attention_layers():
        fused = attn.fused_inputs
        assert fused is not None and fused.current()
        assert fused.sizes == [48, 128, 576]  # q_lora_rank, index_head_dim, kv_lora_rank + rope
        stacked = fused.stacked["weight"]
        for view in _stack_views(attn):
            assert view.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
        assert stacked.untyped_storage().nbytes() == sum(v.numel() * v.element_size() for v in _stack_views(attn))
    # The stack holds the three projections once: the weight accounting sees no second copy.
    expected = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model)["total"] - sum(b.numel() * b.element_size() for b in model.buffers()) == expected


def test_fused_projections_equal_the_separate_ones() -> None:
    model = small_model(torch.float64, seed=2)
    attn = model.attention_layers()[0]
    x = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q_a, k, kv_a = attn.project_inputs(x)
    torch.testing.assert_close(q_a, attn.q_a_proj(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k, attn.indexer.wk(x), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv_a, attn.kv_a_proj_with_mqa(x), rtol=1e-12, atol=1e-12)


def test_loading_fills_the_stack_in_place(tmp_path: Path) -> None:
    source = small_model(torch.float32, seed=5)
    write_checkpoint(source, tmp_path)
    model, _ = load_checkpoint(tmp_path, "cpu", torch.float32)
    for attn in model.attention_layers():
        assert attn.fused_inputs is not None and attn.fused_inputs.current()
        torch.testing.assert_close(attn.fused_inputs.stacked["weight"],
                                   torch.cat([p.detach() for p in _stack_views(attn)]), rtol=0, atol=0)
    assert set(model.state_dict()) == set(source.state_dict())  # the checkpoint's names, nothing added


def test_a_replaced_parameter_is_restacked() -> None:
    model = small_model(torch.float64, seed=4)
    attn = model.attention_layers()[1]
    new = torch.randn_like(attn.q_a_proj.weight)
    attn.q_a_proj.weight = nn.Parameter(new, requires_grad=False)  # no longer a view of the stack
    assert not attn.fused_inputs.current()
    x = torch.randn(3, 64, dtype=torch.float64)
    q_a, _, kv_a = attn.project_inputs(x)
    torch.testing.assert_close(q_a, x @ new.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kv_a, attn.kv_a_proj_with_mqa(x), rtol=1e-12, atol=1e-12)
    assert attn.fused_inputs.current()
    assert attn.q_a_proj.weight.untyped_storage().data_ptr() == (
        attn.fused_inputs.stacked["weight"].untyped_storage().data_ptr())


def test_fp8_blocks_must_line_up() -> None:
    aligned = [_fp8_linear(256, 256, 0), _fp8_linear(256, 128, 1), _fp8_linear(256, 192, 2)]
    assert can_fuse(aligned)  # only the last projection ends in a partial block
    assert not can_fuse([_fp8_linear(256, 192, 3), _fp8_linear(256, 128, 4)])  # a partial block in the middle
    assert not can_fuse([_fp8_linear(256, 128, 5), Linear(256, 64, bias=False)])  # FP8 and bf16 mixed
    assert not can_fuse([Linear(256, 64, bias=True), Linear(256, 64, bias=False)])  # bias on one only
    assert can_fuse([Linear(256, 64, bias=False), Linear(256, 96, bias=False)])  # bf16: any sizes
    assert not can_fuse([Linear(256, 64, bias=False), Linear(128, 64, bias=False)])  # another input width
    assert not can_fuse([Linear(256, 64, bias=False)])
    with pytest.raises(ValueError, match="cannot share"):
        FusedLinear([_fp8_linear(256, 192, 6), _fp8_linear(256, 128, 7)])


def test_fp8_stack_equals_the_separate_fp8_projections() -> None:
    linears = [_fp8_linear(256, 256, 10), _fp8_linear(256, 128, 11), _fp8_linear(256, 192, 12, bias=True)]
    for i, lin in enumerate(linears):
        lin.bias = nn.Parameter(torch.randn(lin.out_features, generator=torch.Generator().manual_seed(i)),
                                requires_grad=False)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(13))
    separate = [lin(x) for lin in linears]
    fused = FusedLinear(linears, copy=True)
    assert fused.stacked["weight_scale_inv"].shape == (5, 2)  # 2 + 1 + 2 row blocks (the last one partial)
    for got, want in zip(fused(x), separate, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)


def test_fp8_warm_up_tunes_the_stacked_shape_not_its_parts() -> None:
    """The FP8 tuner (decode_server/model/fp8_warmup.py) times the GEMM the layer runs: the stack, 128 + 128 + 576
    rows, not q_a, wk and kv_a on their own."""
    from decode_server.model import ModelConfig, build_random_model
    from decode_server.model.fp8_warmup import fp8_workloads

    config = ModelConfig.from_dict(small_config_dict(q_lora_rank=128))
    model = build_random_model(config, "cpu", torch.float32, seed=0, quantization="fp8")
    attn = model.attention_layers()[0]
    assert attn.fused_inputs is not None and "weight_scale_inv" in attn.fused_inputs.stacked
    dense = {tuple(weights[0][0].shape) for kind, weights, _ in fp8_workloads(model) if kind == "dense"}
    assert (128 + 128 + 576, 64) in dense
    assert not dense & {(128, 64), (576, 64)}, dense
