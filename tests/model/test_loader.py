"""Loader: FP8 block dequantization, single-file and sharded checkpoints, MTP skipping, every error case."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dsa_test_helpers import small_config_dict, small_model
from safetensors.torch import save_file

from decode_server.model import CheckpointError
from decode_server.model.fp8 import dequantize_block_fp8, quantize_block_fp8
from decode_server.model.loader import load_checkpoint

FP8_NAMES = ("q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_b_proj.weight", "indexer.wq_b.weight")


def _reference_dequant(w: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(w.shape, dtype=torch.float32)
    for bi in range(math.ceil(w.shape[0] / block)):
        for bj in range(math.ceil(w.shape[1] / block)):
            rows, cols = slice(bi * block, (bi + 1) * block), slice(bj * block, (bj + 1) * block)
            out[rows, cols] = w[rows, cols].float() * s[bi, bj]
    return out


@pytest.mark.parametrize("shape", [(256, 128), (300, 200), (576, 64), (5, 700)])
def test_block_dequant_exact(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=gen) * 3
    fp8, scale_inv = quantize_block_fp8(weight)
    assert scale_inv.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    got = dequantize_block_fp8(fp8, scale_inv)
    assert torch.equal(got, _reference_dequant(fp8, scale_inv))
    assert ((got - weight).abs() <= weight.abs() * 2**-4 + scale_inv.max() * 2**-9).all()
    with pytest.raises(ValueError, match="weight_scale_inv has shape"):
        dequantize_block_fp8(fp8, scale_inv[:, :1].contiguous() if scale_inv.shape[1] > 1 else scale_inv[:0])


def write_checkpoint(model, path: Path, shards: int = 1, mutate=None, config_overrides=None) -> dict:
    """Store `model` as a DeepSeek checkpoint (some FP8 weights), optionally sharded and mutated."""
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().float().contiguous()
        if name.endswith(FP8_NAMES):
            tensors[name], tensors[name + "_scale_inv"] = quantize_block_fp8(tensor)
        else:
            tensors[name] = tensor.to(torch.bfloat16) if name.endswith("embed_tokens.weight") else tensor
    if mutate:
        mutate(tensors)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, str(path / file))
            weight_map.update(dict.fromkeys(part, file))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = small_config_dict(**(config_overrides or {}))
    (path / "config.json").write_text(json.dumps(raw))
    return tensors


def _expected_value(stored: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    tensor = stored[name]
    if tensor.dtype == torch.float8_e4m3fn:
        return dequantize_block_fp8(tensor, stored[name + "_scale_inv"])
    return tensor.float()


@pytest.mark.parametrize("shards", [1, 3])
def test_load_single_and_sharded(tmp_path: Path, shards: int) -> None:
    source = small_model(torch.float32, seed=5)
    stored = write_checkpoint(source, tmp_path, shards=shards)
    model, config = load_checkpoint(tmp_path, "cpu", torch.float32)
    assert config.num_hidden_layers == 2
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor.float(), _expected_value(stored, name)), name
    attn = model.model.layers[1].self_attn
    assert torch.equal(attn.w_uk, attn.kv_b_proj.weight.view(4, 256, 512)[:, :128])
    assert torch.equal(attn.w_uv, attn.kv_b_proj.weight.view(4, 256, 512)[:, 128:])
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_bf16_load_keeps_router_in_fp32(tmp_path: Path) -> None:
    write_checkpoint(small_model(torch.float32), tmp_path)
    model, _ = load_checkpoint(tmp_path, "cpu", "bfloat16")
    assert model.model.layers[0].self_attn.q_b_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_mtp_layer_is_skipped(tmp_path: Path) -> None:
    def add_mtp(tensors):
        tensors["model.layers.2.self_attn.q_a_proj.weight"] = torch.zeros(48, 64)
        tensors["model.layers.2.enorm.weight"] = torch.zeros(64)
    write_checkpoint(small_model(torch.float32), tmp_path, mutate=add_mtp)
    load_checkpoint(tmp_path, "cpu", torch.float32)


def _error(tmp_path: Path, mutate) -> str:
    write_checkpoint(small_model(torch.float32), tmp_path, mutate=mutate)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path, "cpu", torch.float32)
    return str(info.value)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda t: t.pop("model.layers.1.self_attn.indexer.wk.weight"))
    assert "missing tensor model.layers.1.self_attn.indexer.wk.weight (expected shape (128, 64))" in msg


def test_unexpected_tensor_is_named(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda t: t.update({"model.layers.0.self_attn.surprise.weight": torch.zeros(3, 4)}))
    assert "unexpected tensor model.layers.0.self_attn.surprise.weight (shape (3, 4))" in msg


def test_misshaped_tensor_names_both_shapes(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda t: t.update({"model.layers.0.self_attn.o_proj.weight": torch.zeros(64, 500)}))
    assert "tensor model.layers.0.self_attn.o_proj.weight has shape (64, 500), expected (64, 512)" in msg


def test_fp8_without_scale_and_bad_scale(tmp_path: Path) -> None:
    msg = _error(tmp_path, lambda t: t.pop("model.layers.0.self_attn.kv_b_proj.weight_scale_inv"))
    assert "FP8 tensor model.layers.0.self_attn.kv_b_proj.weight has no " in msg
    msg = _error(tmp_path / "b", lambda t: t.update(
        {"model.layers.0.self_attn.kv_b_proj.weight_scale_inv": torch.ones(3, 3)}))
    assert "kv_b_proj.weight_scale_inv has shape (3, 3), expected (8, 4)" in msg


def test_all_problems_reported_together(tmp_path: Path) -> None:
    def several(t):
        t.pop("model.norm.weight")
        t["lm_head.weight"] = torch.zeros(3, 3)
    msg = _error(tmp_path, several)
    assert "2 problems" in msg and "model.norm.weight" in msg and "lm_head.weight has shape (3, 3)" in msg


def test_missing_shard_file(tmp_path: Path) -> None:
    write_checkpoint(small_model(torch.float32), tmp_path, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        load_checkpoint(tmp_path, "cpu", torch.float32)


@pytest.mark.parametrize("quantization", ["auto", "fp8", "none"])
def test_other_quantization_methods_are_refused(tmp_path: Path, quantization: str) -> None:
    """A quantization_config of another method (compressed-tensors, AWQ, ...) is refused by name before any
    tensor is read, in every mode (with "none" it would otherwise fail on its scale tensors)."""
    write_checkpoint(small_model(torch.float32), tmp_path,
                     config_overrides={"quantization_config": {"quant_method": "compressed-tensors"}})
    with pytest.raises(ValueError, match="quant_method 'compressed-tensors' is not supported"):
        load_checkpoint(tmp_path, "cpu", torch.float32, quantization=quantization)
