"""GLM-5 (`glm_moe_dsa`) in the engine: `tiny-glm5`, shared indexer layers without indexer weights or key cache,
HiSparse bit-identical to dense, loader and tokenizer details of shipped checkpoints.

Interop with transformers' own GlmMoeDsaForCausalLM is in test_interop_glm5.py.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.engine import Engine
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.engine.memory import plan_dense_slots, plan_hisparse
from decode_server.engine.sampling_params import SamplingParams
from decode_server.model import ModelConfig, Tokenizer, load_config, load_model, resolve_model_path

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_glm5():
    model, config = load_model("tiny-glm5", "cpu", torch.float32)
    return model, config, Tokenizer.from_dir(resolve_model_path("tiny-glm5"))


def test_tiny_glm5_config() -> None:
    config = load_config("tiny-glm5")
    assert config.model_type == "glm_moe_dsa" and config.indexer_types == ("full", "shared", "full", "shared")
    assert config.kv_row_dim == 576 and (config.qk_nope_head_dim, config.v_head_dim) == (192, 256)
    assert config.indexer_rope_interleave and config.rms_norm_eps == 1e-5 and config.n_group == 1
    assert config.eos_token_ids == [0, 4, 6] and config.to_hf_dict()["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert ModelConfig.from_dict(config.to_hf_dict()) == dataclasses.replace(config, torch_dtype=None)


def test_glm_defaults_and_bad_sharing() -> None:
    defaults = ModelConfig.from_dict({"model_type": "glm_moe_dsa"})
    assert (defaults.hidden_size, defaults.num_attention_heads, defaults.index_n_heads) == (6144, 64, 32)
    assert (defaults.qk_nope_head_dim, defaults.v_head_dim, defaults.rms_norm_eps) == (192, 256, 1e-5)
    assert defaults.index_layer_ids == tuple(range(78))  # index_topk_freq 1: every layer full
    with pytest.raises(ValueError, match="must be 'full'"):
        ModelConfig.from_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": 2,
                               "indexer_types": ["shared", "full"]})
    with pytest.raises(ValueError, match="2 entries for 3 layers"):
        ModelConfig.from_dict({"model_type": "glm_moe_dsa", "num_hidden_layers": 3, "index_topk_pattern": "FS"})


def test_shared_layers_have_no_indexer_weights_or_keys(tiny_glm5) -> None:
    model, config, _ = tiny_glm5
    names = [n for n in model.state_dict() if ".indexer." in n]
    assert {int(n.split(".")[2]) for n in names} == {0, 2}
    geometry = CacheGeometry.from_model_config(config)
    assert geometry.index_layer_ids == (0, 2) and geometry.index_slots() == {0: 0, 2: 1}
    # 4 MLA rows (bf16: 1152 B) + 2 indexer keys (132 B) per token, not 4.
    assert geometry.bytes_per_token(torch.bfloat16) == 4 * 1152 + 2 * 132
    cfg = EngineConfig(device="cpu", device_kv_budget_bytes=64 << 20, page_size=16)
    all_full = CacheGeometry(4)
    assert plan_dense_slots(cfg, CPU, 4, torch.bfloat16, geometry) > plan_dense_slots(
        cfg, CPU, 4, torch.bfloat16, all_full)
    hs = cfg.model_copy(update={"enable_hisparse": True, "host_kv_budget_bytes": 256 << 20})
    shared = plan_hisparse(hs, CPU, 4, 64, torch.bfloat16, 4096, geometry)
    full = plan_hisparse(hs, CPU, 4, 64, torch.bfloat16, 4096, all_full)
    assert shared.indexer_bytes_per_token == 2 * 132 and full.indexer_bytes_per_token == 4 * 132
    assert shared.indexer_pages > full.indexer_pages or shared.num_buffers > full.num_buffers


def _engine(tiny, hisparse: bool) -> Engine:
    model, config, tokenizer = tiny
    cfg = EngineConfig(device="cpu", enable_hisparse=hisparse, page_size=16, chunked_prefill_size=64,
                       device_kv_budget_bytes=32 << 20,
                       hisparse=HiSparseConfig(device_buffer_size=64, num_recent_slots=2))
    return Engine(cfg, model=model, model_config=config, tokenizer=tokenizer)


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int):
    logits: dict[str, list[torch.Tensor]] = {}
    engine.logits_hook = lambda rids, lg: [logits.setdefault(r, []).append(lg[i].clone())
                                           for i, r in enumerate(rids)]
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens.setdefault(delta.rid, []).extend(delta.new_token_ids)
    assert engine.is_idle_and_empty()
    return tokens, logits


def test_tiny_glm5_hisparse_identical_to_dense(tiny_glm5) -> None:
    """Prompts past index_topk (64) and the buffer (64): the shared layers swap in the full layers'
    selections; tokens and logits are bit-identical to dense."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(7, 1024, (n,), generator=gen).tolist() for n in (80, 100, 30)]
    dense = _engine(tiny_glm5, hisparse=False)
    assert dense.kv.cache.index_keys.shape[0] == 2 and dense.kv.cache.kv.shape[0] == 4
    dense_tokens, dense_logits = _run(dense, prompts, 6)
    hs = _engine(tiny_glm5, hisparse=True)
    assert hs.kv.indexer.keys.shape[0] == 2 and hs.kv.buffers.kv.shape[0] == 4
    hs_tokens, hs_logits = _run(hs, prompts, 6)
    assert dense_tokens == hs_tokens
    assert len({tuple(t) for t in dense_tokens.values()}) == 3  # prompt-dependent outputs
    for rid, steps in dense_logits.items():
        assert all(torch.equal(a, b) for a, b in zip(steps, hs_logits[rid], strict=True))
    # Swap-in ran in every layer, shared ones included (they attend the full layers' selections).
    layer_stats = hs.kv.layer_stats()
    assert len(layer_stats) == 4 and all(s.hits + s.misses > 0 for s in layer_stats)


def test_tiny_glm5_chat_template(tiny_glm5) -> None:
    _, config, tokenizer = tiny_glm5
    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hello"}])
    assert text == "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHello<|assistant|>\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:3] == [1, 2, 3] and tokenizer.eos_token_id in config.eos_token_ids
    assert tokenizer.encode("Hello") == tokenizer.encode("Hello", add_special_tokens=False)  # no BOS added


def test_chat_template_jinja_file_and_shared_layer_indexer_weights(tmp_path: Path) -> None:
    """A checkpoint as transformers >= 4.5x writes it (template in chat_template.jinja) and with indexer
    weights for shared layers (ignored: those layers never run an indexer)."""
    src = resolve_model_path("tiny-glm5")
    dst = tmp_path / "glm"
    shutil.copytree(src, dst)
    tok_config = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "chat_template.jinja").write_text(tok_config.pop("chat_template"))
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_config))
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.startswith("model.layers.0.self_attn.indexer.")]:
        tensors[name.replace("layers.0.", "layers.1.")] = tensors[name].clone()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    tokenizer = Tokenizer.from_dir(dst)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).startswith("[gMASK]<sop><|user|>")
    model, _ = load_model(dst, "cpu", torch.float32)
    assert model.model.layers[1].self_attn.indexer is None
