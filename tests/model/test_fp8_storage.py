"""Block-FP8 weight storage (decode_server/model/quantization.py) on CPU: FP8 checkpoints still load dequantized by
default on CPU; with `quantization="fp8"` the checkpoint's FP8 bytes and scales are what the model holds, whole
or cut by the tensor-parallel loader on block edges (misaligned pieces refused, or dequantized under "auto"); the
forward pass equals the dequantized model's once the activation rounding is taken out; random FP8 models and the
checkpoint writer round trip; weight bytes are counted by kind."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from dsa_test_helpers import dense_backend, forward_tokens
from safetensors import safe_open

import decode_server.model.loader as loader
import kernels.fp8_gemm as fp8_gemm
from decode_server.model import ModelConfig, build_random_model, load_model, resolve_model_path
from decode_server.model.checkpoint_writer import checkpoint_tensors, save_checkpoint
from decode_server.model.construct import build_empty_model, dequantized_copy, piece
from decode_server.model.fp8 import dequantize_block_fp8
from decode_server.model.quantization import Fp8LayoutError, is_fp8_projection
from decode_server.model.weights import weight_bytes
from decode_server.parallel.layers import parameter_shards
from decode_server.parallel.state import ParallelState
from kernels.fp8_gemm_ref import fp8_bmm_ref, fp8_grouped_ref, fp8_linear_ref

FP8 = torch.float8_e4m3fn
# Every tensor-parallel piece at TP=2 falls on 128-block edges (tiny-dsa's 128-wide experts do not).
ALIGNED = {
    "model_type": "deepseek_v32", "vocab_size": 256, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 256, "num_hidden_layers": 2, "first_k_dense_replace": 1, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 256, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "index_n_heads": 4,
    "index_head_dim": 128, "index_topk": 16, "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


@pytest.fixture(scope="module")
def tiny_fp8():
    return load_model("tiny-dsa", "cpu", torch.float32, quantization="fp8")


@pytest.fixture(scope="module")
def aligned_checkpoint(tmp_path_factory):
    """A random FP8 model of ALIGNED written by the project's writer in 3+ shards."""
    config = ModelConfig.from_dict(ALIGNED)
    model = build_random_model(config, "cpu", torch.float32, seed=7, quantization="fp8")
    path = tmp_path_factory.mktemp("aligned-fp8")
    files = save_checkpoint(checkpoint_tensors(model), config.to_hf_dict(), path, max_shard_bytes=1 << 20)
    assert len(files) >= 3
    return path, model


def test_tiny_fp8_weights_are_the_checkpoint_bytes(tiny_fp8) -> None:
    model, _ = tiny_fp8
    assert model.quantization == "fp8"
    state = model.state_dict()
    stored = {}
    with safe_open(str(resolve_model_path("tiny-dsa") / "model.safetensors"), framework="pt") as handle:
        for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
            stored[name] = handle.get_tensor(name)
    fp8_names = [n for n, t in stored.items() if t.dtype == FP8]
    assert len(fp8_names) > 20
    for name in fp8_names:
        assert state[name].dtype == FP8, name
        assert torch.equal(state[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(state[name + "_scale_inv"], stored[name + "_scale_inv"]), name
    # Not FP8 in the checkpoint (kv_a: ragged, stored bf16 by tiny-dsa), or never FP8 (router, weights_proj).
    assert state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"].dtype == torch.float32
    assert state["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert state["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    assert state["model.embed_tokens.weight"].dtype == torch.float32
    # tiny-dsa's heads (nope 128, v 128, latent 512) are whole 128-blocks: the absorbed products read kv_b_proj's
    # own FP8 values — W_UV as a view of its v rows, W_UKᵀ as a transposed copy of its nope rows — and scales.
    attn = model.model.layers[0].self_attn
    assert attn.absorbed_fp8
    heads = attn.kv_b_proj.weight.view(16, 256, 512)
    blocks = attn.kv_b_proj.weight_scale_inv.view(16, 2, 4)
    assert attn.w_uk.dtype == FP8 and attn.w_uk.shape == (16, 512, 128)
    assert torch.equal(attn.w_uk.view(torch.uint8), heads[:, :128].transpose(1, 2).view(torch.uint8))
    assert torch.equal(attn.w_uk_scale, blocks[:, :1].transpose(1, 2))
    assert attn.w_uv.untyped_storage().data_ptr() == attn.kv_b_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(attn.w_uv.view(torch.uint8), heads[:, 128:].view(torch.uint8))
    assert torch.equal(attn.w_uv_scale, blocks[:, 1:])


def test_heads_that_cut_through_fp8_blocks_absorb_dequantized() -> None:
    """GLM-5's heads (nope 192, v 256 rows of kv_b_proj) do not start and end on 128-row blocks: W_UK / W_UV are
    kv_b_proj dequantized into the model dtype, multiplied as bf16 batched matmuls (no FP8 absorbed products)."""
    from decode_server.model import load_config

    config = load_config("tiny-glm5")
    model = build_random_model(config, "cpu", torch.float32, seed=2, quantization="fp8")
    attn = model.model.layers[0].self_attn
    assert attn.kv_b_proj.weight.dtype == FP8 and not attn.absorbed_fp8
    w = dequantize_block_fp8(attn.kv_b_proj.weight, attn.kv_b_proj.weight_scale_inv).view(attn.num_heads, 448, 512)
    assert attn.w_uk.dtype == torch.float32 and torch.equal(attn.w_uk, w[:, :192])
    assert torch.equal(attn.w_uv, w[:, 192:])
    assert weight_bytes(model)["absorbed"] == sum(
        a.w_uk.nbytes + a.w_uv.nbytes for a in model.attention_layers())


def test_cpu_default_dequantizes_as_before(tiny_fp8) -> None:
    model, _ = tiny_fp8
    default, _ = load_model("tiny-dsa", "cpu", torch.float32)
    assert default.quantization == "none"
    assert all(p.dtype != FP8 for p in default.parameters())
    reference = dequantized_copy(model).state_dict()
    none_state = load_model("tiny-dsa", "cpu", torch.float32, quantization="none")[0].state_dict()
    for name, tensor in default.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
        assert torch.equal(tensor, none_state[name]), name


def _logits(model, config, prompt):
    backend = dense_backend(config)
    backend.reserve(0, len(prompt))
    return model.compute_logits(forward_tokens(model, backend, [0], [0], [prompt]))


def test_fp8_forward_is_the_dequantized_model_up_to_activation_rounding(tiny_fp8, monkeypatch) -> None:
    model, config = tiny_fp8
    dequantized = dequantized_copy(model)
    prompt = torch.randint(2, 1000, (72,), generator=torch.Generator().manual_seed(3)).tolist()
    expected = _logits(dequantized, config, prompt)
    rounded = _logits(model, config, prompt)
    monkeypatch.setattr(fp8_gemm, "fp8_linear_ref", functools.partial(fp8_linear_ref, quantize_input=False))
    monkeypatch.setattr(fp8_gemm, "fp8_grouped_ref", functools.partial(fp8_grouped_ref, quantize_input=False))
    monkeypatch.setattr(fp8_gemm, "fp8_bmm_ref", functools.partial(fp8_bmm_ref, quantize_input=False))
    exact = _logits(model, config, prompt)
    # Same weights, same arithmetic once the activations are not rounded: the FP8 layers are wired right.
    assert torch.equal(exact, expected)
    # With the activation rounding (random weights amplify it; 0.78 agreement measured): close, not equal.
    assert not torch.equal(rounded, expected)
    agreement = (rounded.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agreement >= 0.6, agreement


def test_experts_share_one_stacked_storage_and_bytes_are_counted_by_kind(tiny_fp8) -> None:
    model, _ = tiny_fp8
    moe = model.model.layers[1].mlp
    (gate, gate_scale), _, _ = moe.stacked()
    for i, expert in enumerate(moe.local_experts()):
        assert expert.gate_proj.weight.untyped_storage().data_ptr() == gate.untyped_storage().data_ptr()
        assert torch.equal(expert.gate_proj.weight.view(torch.uint8), gate[i].view(torch.uint8))
        assert torch.equal(expert.gate_proj.weight_scale_inv, gate_scale[i])
    counted = weight_bytes(model)
    params = dict(model.named_parameters())
    fp8 = sum(p.numel() for p in params.values() if p.dtype == FP8)
    scales = sum(4 * p.numel() for n, p in params.items() if n.endswith("weight_scale_inv"))
    # FP8 absorbed products: the W_UKᵀ copy and its scales are the absorbed bytes; W_UV and its scales are views
    # of kv_b_proj's (counted there, once).
    layers = model.attention_layers()
    assert all(a.absorbed_fp8 for a in layers)
    absorbed = sum(a.w_uk.nbytes + a.w_uk_scale.nbytes for a in layers)
    assert counted["fp8"] == fp8 and counted["fp8_scales"] == scales and counted["absorbed"] == absorbed
    views = sum(a.w_uv.nbytes + a.w_uv_scale.nbytes for a in layers)
    every = sum(t.nbytes for t in model.parameters()) + sum(b.nbytes for b in model.buffers()) - views
    assert counted["total"] == every == sum(counted[k] for k in ("fp8", "fp8_scales", "absorbed", "other"))


def test_random_fp8_model_is_drawn_in_fp8() -> None:
    config = ModelConfig.from_dict(ALIGNED)
    model = build_random_model(config, "cpu", torch.float32, seed=1, quantization="fp8")
    again = build_random_model(config, "cpu", torch.float32, seed=1, quantization="fp8")
    state, state2 = model.state_dict(), again.state_dict()
    projections = [n for n in state if is_fp8_projection(n)]
    assert projections and all(state[n].dtype == FP8 for n in projections)
    assert all(torch.equal(state[n].view(torch.uint8), state2[n].view(torch.uint8)) for n in projections)
    q_b = "model.layers.0.self_attn.q_b_proj.weight"
    scale = state[q_b + "_scale_inv"]
    assert scale.shape == (6, 2) and scale.unique().numel() == scale.numel()  # every block its own scale
    w = dequantize_block_fp8(state[q_b], scale)
    assert abs(w.std().item() * 256**0.5 - 1.0) < 0.15  # unit gain, as the float random model


def test_writer_round_trip_keeps_the_fp8_bytes(aligned_checkpoint) -> None:
    path, original = aligned_checkpoint
    loaded, _ = load_model(path, "cpu", torch.float32, quantization="fp8")
    a, b = original.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        if tensor.dtype == FP8:
            assert torch.equal(tensor.view(torch.uint8), b[name].view(torch.uint8)), name
        elif name.endswith("_scale_inv"):
            assert torch.equal(tensor, b[name]), name
        else:  # embeddings, router, weights_proj pass through bf16 in the stored form
            torch.testing.assert_close(b[name], tensor, rtol=2**-8, atol=0)
    dequantized, _ = load_model(path, "cpu", torch.float32, quantization="none")
    reference = dequantized_copy(loaded).state_dict()
    assert all(torch.equal(t, reference[n]) for n, t in dequantized.state_dict().items())


@pytest.mark.parametrize("ep_size", [1, 2])
def test_tensor_parallel_fp8_pieces_are_slices(aligned_checkpoint, ep_size: int) -> None:
    path, _ = aligned_checkpoint
    whole, _ = load_model(path, "cpu", torch.float32, quantization="fp8")
    full = whole.state_dict()
    for rank in range(2):
        model, _ = load_model(path, "cpu", torch.float32, parallel=ParallelState(rank, 2, ep_size),
                              quantization="fp8")
        shards = parameter_shards(model)
        fp8_seen = 0
        for name, tensor in model.state_dict().items():
            expected = piece(full[name], shards.get(name))
            if tensor.dtype == FP8:
                fp8_seen += 1
                assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8)), name
            else:
                assert torch.equal(tensor, expected), name
        assert fp8_seen > 10
        assert any(n.endswith("_scale_inv") and s.count == 2 for n, s in shards.items())


def test_random_tensor_parallel_fp8_model_is_the_whole_one_cut() -> None:
    config = ModelConfig.from_dict(ALIGNED)
    full = build_random_model(config, "cpu", torch.float32, seed=5, quantization="fp8").state_dict()
    for ep_size in (1, 2):
        model = build_random_model(config, "cpu", torch.float32, seed=5, parallel=ParallelState(1, 2, ep_size),
                                   quantization="fp8")
        shards = parameter_shards(model)
        for name, tensor in model.state_dict().items():
            expected = piece(full[name], shards.get(name))
            assert torch.equal(tensor.view(torch.uint8) if tensor.dtype == FP8 else tensor,
                               expected.view(torch.uint8) if tensor.dtype == FP8 else expected), name


def test_tensor_parallel_fp8_absorbed_products_are_the_ranks_heads() -> None:
    """With TP each rank's FP8 W_UKᵀ / W_UV (and scales) are its heads' slices of the whole model's: kv_b_proj is
    cut by heads, whole 128-blocks each."""
    config = ModelConfig.from_dict(ALIGNED)
    whole = build_random_model(config, "cpu", torch.float32, seed=5, quantization="fp8")
    for rank in range(2):
        model = build_random_model(config, "cpu", torch.float32, seed=5, parallel=ParallelState(rank, 2),
                                   quantization="fp8")
        heads = slice(2 * rank, 2 * rank + 2)
        for mine, all_heads in zip(model.attention_layers(), whole.attention_layers(), strict=True):
            assert mine.absorbed_fp8 and all_heads.absorbed_fp8
            for name in ("w_uk", "w_uv"):
                assert torch.equal(getattr(mine, name).view(torch.uint8),
                                   getattr(all_heads, name)[heads].view(torch.uint8)), name
                assert torch.equal(getattr(mine, f"{name}_scale"), getattr(all_heads, f"{name}_scale")[heads])


def test_pieces_that_cut_through_blocks_are_refused_or_dequantized(monkeypatch, caplog) -> None:
    # tiny-dsa's experts are 128 wide: at TP=2 each rank would hold 64 rows of gate/up and 64 columns of down.
    with pytest.raises(Fp8LayoutError, match=r"experts\.0\.down_proj\.weight: 64 columns"):
        load_model("tiny-dsa", "cpu", torch.float32, parallel=ParallelState(0, 2), quantization="fp8")
    config = ModelConfig.from_json(resolve_model_path("tiny-dsa"))
    with pytest.raises(Fp8LayoutError, match="--quantization none"):
        build_empty_model(config, "meta", torch.float32, ParallelState(1, 2), fp8=True)
    # "auto" (as on CUDA) falls back to dequantizing, saying why.
    monkeypatch.setattr(loader, "wants_fp8", lambda mode, config, device: True)
    with caplog.at_level(logging.WARNING, logger="decode_server.model.loader"):
        model, _ = load_model("tiny-dsa", "cpu", torch.float32, parallel=ParallelState(0, 2), quantization="auto")
    assert model.quantization == "none"
    assert "dequantizing the FP8 weights instead" in caplog.text


def test_fp8_needs_a_block_fp8_checkpoint(tmp_path, aligned_checkpoint) -> None:
    _, model = aligned_checkpoint
    floats = {n: dequantize_block_fp8(t, model.state_dict()[n + "_scale_inv"]) if t.dtype == FP8 else t.float()
              for n, t in model.state_dict().items() if not n.endswith("_scale_inv")}
    save_checkpoint(floats, model.config.to_hf_dict(), tmp_path)
    with pytest.raises(ValueError, match="needs a block-FP8 checkpoint"):
        load_model(tmp_path, "cpu", torch.float32, quantization="fp8")
    assert load_model(tmp_path, "cpu", torch.float32)[0].quantization == "none"
    with pytest.raises(ValueError, match="quantization 'int4'"):
        load_model(tmp_path, "cpu", torch.float32, quantization="int4")
