"""Projections of one input as one GEMM (decode_server/model/fused_linear.py): MLA's q_a, the indexer's wk and kv_a,
MLA's q_b and the indexer's wq_b (both of the query latent), and the gate and up projections of the dense and shared-expert MLPs, each group sharing one stacked weight that
their parameters are views of, built at construction and filled by the loader in place."""

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


def test_construction_stacks_q_b_and_wq_b_and_the_attention_uses_them() -> None:
    """q_b and the indexer's wq_b read the normalized query latent: one stack, q_b's rows first; the layer's
    outputs equal those of the same weights run apart (float64: any summation order is far below the tolerance)."""

    model = small_model(torch.float64, seed=7)
    for attn in model.attention_layers():
        fused = attn.fused_queries
        assert fused is not None and fused.current()
        assert fused.sizes == [attn.q_b_proj.out_features, attn.indexer.wq_b.out_features]
        stacked = fused.stacked["weight"]
        for proj in attn.query_projections():
            assert proj.weight.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    attn = model.attention_layers()[0]
    latent = torch.randn(4, attn.q_b_proj.in_features, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(8))
    q, index_q = attn.project_queries(latent)
    torch.testing.assert_close(q, latent @ attn.q_b_proj.weight.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(index_q, latent @ attn.indexer.wq_b.weight.T, rtol=1e-12, atol=1e-12)
    cos = torch.randn(4, attn.rope_dim // 2, dtype=torch.float64)
    sin = torch.randn(4, attn.rope_dim // 2, dtype=torch.float64)
    torch.testing.assert_close(attn.absorbed_query(latent, cos, sin, q), attn.absorbed_query(latent, cos, sin),
                               rtol=0, atol=0)
    x = torch.randn(4, 64, dtype=torch.float64)
    cos32, sin32 = cos.float(), sin.float()
    apart, joined = attn.indexer(x, latent, cos32, sin32), attn.indexer(x, latent, cos32, sin32, q_proj=index_q)
    assert torch.equal(apart.q, joined.q) and torch.equal(apart.weights, joined.weights)


def test_layers_without_an_indexer_keep_q_b_alone() -> None:
    model = small_model(torch.float64, seed=9)
    attn = model.attention_layers()[0]
    attn.indexer = None
    attn.fused_queries = None
    attn.fuse_query_projections()
    assert attn.fused_queries is None and attn.project_queries(torch.zeros(1, attn.q_b_proj.in_features,
                                                                           dtype=torch.float64)) == (None, None)


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


def test_fp8_warm_up_tunes_the_stacked_shapes_not_their_parts() -> None:
    """The FP8 tuner (decode_server/model/fp8_warmup.py) times the GEMMs the layers run: the stacks (128 + 128 + 576
    rows; gate + up of the dense MLP and of the shared expert), not q_a, wk and kv_a on their own."""
    from decode_server.model import ModelConfig, build_random_model
    from decode_server.model.fp8_warmup import fp8_workloads

    config = ModelConfig.from_dict(small_config_dict(q_lora_rank=128, intermediate_size=384,
                                                     moe_intermediate_size=128))
    model = build_random_model(config, "cpu", torch.float32, seed=0, quantization="fp8")
    attn = model.attention_layers()[0]
    assert attn.fused_inputs is not None and "weight_scale_inv" in attn.fused_inputs.stacked
    dense = {tuple(weights[0][0].shape) for kind, weights, *_ in fp8_workloads(model) if kind == "dense"}
    q_b = attn.q_b_proj.out_features
    wq_b = attn.indexer.wq_b.out_features
    assert {(128 + 128 + 576, 64), (2 * 384, 64), (2 * 128, 64), (q_b + wq_b, 128)} <= dense, dense
    assert not dense & {(576, 64), (384, 64), (q_b, 128), (wq_b, 128)}, dense  # never run alone


def test_dense_and_shared_expert_mlps_stack_gate_and_up_routed_experts_do_not() -> None:
    model = small_model(torch.float64, seed=6)
    dense_mlp = model.model.layers[0].mlp
    moe = model.model.layers[1].mlp
    for mlp in (dense_mlp, moe.shared_experts):
        fused = mlp.fused_gate_up
        assert fused is not None and fused.current() and fused.sizes == [mlp.gate_proj.out_features] * 2
    for expert in moe.local_experts():
        assert expert.fused_gate_up is None  # views of the MoE's expert stacks instead
        assert expert.gate_proj.weight.untyped_storage().data_ptr() == (
            moe.stacked()[0][0].untyped_storage().data_ptr())
    x = torch.randn(6, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for mlp in (dense_mlp, moe.shared_experts):
        want = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)


def test_fp8_projections_stack_only_where_the_stacked_shape_is_tuned(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU in table mode an FP8 stack whose shape the GPU's table lacks would run an untimed default, which
    can be slower than the tuned separate GEMMs: such projections stay separate (bf16 ones always stack)."""
    from decode_server.model import fused_linear

    fp8 = [_fp8_linear(256, 256, 20), _fp8_linear(256, 128, 21)]
    bf16 = [Linear(256, 64, bias=False), Linear(256, 32, bias=False)]
    assert fused_linear.worth_stacking(fp8) and fused_linear.worth_stacking(bf16)  # CPU: always
    asked: list[tuple] = []
    monkeypatch.setattr(fused_linear, "dense_shape_tuned", lambda n, k, device: asked.append((n, k)) or False)
    assert not fused_linear.worth_stacking(fp8) and asked == [(384, 256)]
    assert fused_linear.worth_stacking(bf16)


def test_dense_and_grouped_shape_tuned_read_this_gpu_models_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.fp8_gemm_table as table_module
    from kernels import fp8_gemm

    table = {("dense", 2240, 7168, 0, 1, "bfloat16"): ("triton", None),
             ("grouped", 4096, 7168, 32, 8, "bfloat16"): ("triton", None)}
    monkeypatch.setattr(table_module, "device_table", lambda name: table if name == "GPU X" else {})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "GPU X")
    gpu = torch.device("cuda", 0)
    fp8_gemm.reset_tuner("table")
    try:
        assert fp8_gemm.dense_shape_tuned(2240, 7168, gpu)
        assert not fp8_gemm.dense_shape_tuned(4096, 7168, gpu)  # only a grouped entry of that shape
        assert fp8_gemm.dense_shape_tuned(4096, 7168, torch.device("cpu"))
        # The grouped form (the MoE's joined gate/up stack): keyed by the expert count too.
        assert fp8_gemm.grouped_shape_tuned(4096, 7168, 32, gpu)
        assert not fp8_gemm.grouped_shape_tuned(4096, 7168, 16, gpu)  # another expert count: another key
        assert not fp8_gemm.grouped_shape_tuned(2240, 7168, 32, gpu)  # only a dense entry of that shape
        assert fp8_gemm.grouped_shape_tuned(2240, 7168, 32, torch.device("cpu"))
        fp8_gemm.reset_tuner("measure")
        assert fp8_gemm.dense_shape_tuned(4096, 7168, gpu)  # the tuner times whatever it meets
        assert fp8_gemm.grouped_shape_tuned(2240, 7168, 32, gpu)
    finally:
        fp8_gemm.reset_tuner()
