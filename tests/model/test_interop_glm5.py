"""Interoperability with transformers' GlmMoeDsaForCausalLM (GLM-5, the reference implementation, test-only).

Random small checkpoints written by transformers' own `save_pretrained`, with full and shared indexer layers
mixed, GLM-5's head sizes (nope 192, v 256), n_group 1, decoder rms_norm_eps 1e-5 (latent norms 1e-6) and the
interleaved indexer RoPE. While every position is selected (prompt <= index_topk) our float32 logits equal
transformers'; past index_topk they are equal too once our FP8 key packing is replaced by full precision (which
is what transformers scores with), which checks the indexer RoPE layout and the cross-layer top-k sharing. The
same checkpoint stored as shipped (FP8 block weights, 3 shards, an MTP layer) loads in both and agrees.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from dsa_test_helpers import ListBackend, dense_backend, greedy_generate, prefill_logits
from safetensors.torch import load_file, save_file

from decode_server.model import ModelConfig, load_model
from decode_server.model.config import parse_indexer_types
from decode_server.model.tiny import _stored_form

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers reads FP8 checkpoints only with it

VOCAB = 211
SHARING = ["full", "shared", "full", "shared"]


def _hf_config(index_topk: int, **extra):
    return transformers.GlmMoeDsaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=192, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, n_group=1,
        topk_group=1, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=128,
        qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, index_n_heads=16, index_head_dim=128,
        index_topk=index_topk, first_k_dense_replace=1, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=0, eos_token_id=1, **extra,
    )


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    """Unit-gain weights (transformers' default std 0.02 would make attention nearly uniform)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if "norm" in name and name.endswith("weight"):
            tensor.copy_(1 + 0.1 * torch.randn(tensor.shape, generator=gen))
        elif name.endswith("e_score_correction_bias") or name.endswith("bias"):
            tensor.copy_(0.05 * torch.randn(tensor.shape, generator=gen))
        elif "embed_tokens" in name:
            tensor.copy_(torch.randn(tensor.shape, generator=gen))
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=gen) / math.sqrt(tensor.shape[-1]))


@pytest.fixture(scope="module")
def glm_checkpoints(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for key, topk in (("sparse", 32), ("dense", 512)):
        model = transformers.GlmMoeDsaForCausalLM(_hf_config(topk, indexer_types=SHARING)).eval()
        _randomize(model, seed=11)
        path = tmp_path_factory.mktemp(f"glm_{key}")
        model.save_pretrained(path)
        out[key] = path
    return out


def _hf_model(path: Path, **kwargs):
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    return model.float().eval()


def _hf_logits(path: Path, tokens: list[int], **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return _hf_model(path, **kwargs)(torch.tensor([tokens])).logits[0].float()


def _ours(path: Path, tokens: list[int]) -> torch.Tensor:
    model, _ = load_model(path, "cpu", torch.float32)
    return prefill_logits(model, ListBackend(), tokens)


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config_as_transformers_writes_it(glm_checkpoints) -> None:
    raw = json.loads((glm_checkpoints["sparse"] / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    assert config.model_type == "glm_moe_dsa" and config.indexer_types == tuple(SHARING)
    assert config.index_layer_ids == (0, 2) and config.indexer_rope_interleave
    assert config.rms_norm_eps == 1e-5 and config.n_group == 1
    assert config.softmax_scale == pytest.approx(256**-0.5)
    model, _ = load_model(glm_checkpoints["sparse"], "cpu", torch.float32)
    assert [layer.self_attn.indexer is None for layer in model.model.layers] == [False, True, False, True]
    assert model.model.layers[0].input_layernorm.eps == 1e-5
    assert model.model.layers[0].self_attn.kv_a_layernorm.eps == 1e-6  # as transformers: latent norms keep 1e-6


@pytest.mark.parametrize("spelling", [
    {"index_topk_pattern": "FSSFSF"}, {"index_topk_pattern": ["full", "full", "shared", "full", "shared", "full"]},
    {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1}, {},
])
def test_indexer_type_spellings_match_transformers(spelling: dict) -> None:
    theirs = transformers.GlmMoeDsaConfig(num_hidden_layers=6, **spelling).indexer_types
    assert parse_indexer_types(spelling, 6) == tuple(theirs)


@pytest.mark.parametrize("which", ["dense", "sparse"])
def test_logits_match_within_index_topk(glm_checkpoints, which: str) -> None:
    tokens = _prompt(96 if which == "dense" else 32, seed=1)
    ours, theirs = _ours(glm_checkpoints[which], tokens), _hf_logits(glm_checkpoints[which], tokens)
    assert theirs.std() > 0.5  # non-trivial logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def _exact_index_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the FP8 packing: keep keys in float32 with scale 1 (the test backend accepts it)."""
    return keys.float(), torch.ones(keys.shape[0])


def test_full_precision_indexer_matches_beyond_index_topk(glm_checkpoints, monkeypatch) -> None:
    """Past index_topk, with keys in full precision: interleaved indexer RoPE and top-k sharing as transformers."""
    monkeypatch.setattr("decode_server.model.fused_ops.quantize_index_keys", _exact_index_keys)
    path = glm_checkpoints["sparse"]
    tokens = _prompt(160, seed=10)
    model, _ = load_model(path, "cpu", torch.float32)
    backend = ListBackend()
    ours = prefill_logits(model, backend, tokens)
    assert [layer for layer, _ in backend.topk_log] == [0, 2]  # shared layers ran no indexer
    torch.testing.assert_close(ours, _hf_logits(path, tokens), rtol=1e-4, atol=1e-4)


def test_greedy_tokens_equal(glm_checkpoints) -> None:
    """Prefill + token-by-token decode through the engine's DenseBackend = transformers' generate (greedy)."""
    path = glm_checkpoints["dense"]
    prompt = _prompt(24, seed=4)
    model, config = load_model(path, "cpu", torch.float32)
    ours = greedy_generate(model, dense_backend(config), prompt, steps=12)
    with torch.no_grad():
        theirs = _hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert ours == theirs


def _write_shipped_form(src: Path, dst: Path, num_layers: int) -> None:
    """The checkpoint as GLM-5-FP8 ships: projections FP8 e4m3 + 128×128 `weight_scale_inv`, 3 shards with an
    index, and an MTP layer (model.layers.{num_layers}.*) that loaders must ignore."""
    dst.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        tensors.update(_stored_form(name, tensor, (128, 128)))
        if name.startswith("model.layers.1."):  # an MTP layer: a copy of a decoder layer after the last one
            tensors[name.replace("model.layers.1.", f"model.layers.{num_layers}.")] = tensor.clone()
    names = sorted(tensors)
    weight_map = {}
    for shard in range(3):
        file = f"model-{shard + 1:05d}-of-00003.safetensors"
        part = {n: tensors[n].contiguous() for n in names[shard::3]}
        save_file(part, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    raw["num_nextn_predict_layers"] = 1
    (dst / "config.json").write_text(json.dumps(raw))


def test_fp8_block_sharded_checkpoint_with_mtp(glm_checkpoints, tmp_path) -> None:
    path = tmp_path / "glm_fp8"
    _write_shipped_form(glm_checkpoints["dense"], path, num_layers=4)
    assert any(n.endswith("weight_scale_inv") for n in
               json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])
    tokens = _prompt(40, seed=3)
    ours = _ours(path, tokens)
    theirs = _hf_logits(path, tokens, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)
    # The dequantized FP8 weights differ from the float originals: the comparison was not trivially float.
    assert (ours - _ours(glm_checkpoints["dense"], tokens)).abs().max() > 1e-3


def test_tiny_glm5_loads_in_transformers(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HISPARSE_CACHE_DIR", str(tmp_path))
    from decode_server.model import resolve_model_path

    path = resolve_model_path("tiny-glm5")
    tokens = _prompt(40, seed=5)
    theirs = _hf_logits(path, tokens, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    torch.testing.assert_close(_ours(path, tokens), theirs, rtol=1e-3, atol=1e-3)
