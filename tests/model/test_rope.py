"""RoPE layouts against the explicit complex-number formula; YaRN frequencies, mscale and softmax scale."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from decode_server.model.config import ModelConfig, RopeConfig, yarn_mscale
from decode_server.model.rope import (
    RotaryEmbedding,
    apply_rope_half_split,
    apply_rope_interleaved,
    inverse_frequencies,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _explicit(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, pairs: list[tuple[int, int]]):
    """Rotate each (i, j) pair as the complex number x_i + i·x_j times e^{i·p·f_k}."""
    out = x.clone()
    for k, (i, j) in enumerate(pairs):
        angle = positions.double() * inv_freq[k]
        z = torch.complex(x[..., i].double(), x[..., j].double()) * torch.polar(torch.ones_like(angle), angle)[:, None]
        out[..., i], out[..., j] = z.real, z.imag
    return out


@pytest.mark.parametrize("layout", ["interleaved", "half_split"])
def test_rope_layouts_match_explicit_formula(layout: str) -> None:
    dim, heads = 64, 3
    rope = RopeConfig(rope_type="default", rope_theta=10000.0)
    emb = RotaryEmbedding(rope, dim)
    positions = torch.tensor([0, 1, 7, 300, 16383, 100_000])
    x = torch.randn(len(positions), heads, dim, dtype=torch.float64)
    cos, sin = emb(positions, torch.float64)
    if layout == "interleaved":
        got = apply_rope_interleaved(x, cos, sin)
        pairs = [(2 * k, 2 * k + 1) for k in range(dim // 2)]
    else:
        got = apply_rope_half_split(x, cos, sin)
        pairs = [(k, k + dim // 2) for k in range(dim // 2)]
    want = _explicit(x, positions, emb.inv_freq, pairs)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    # Position 0 is the identity; rotation preserves each pair's norm.
    torch.testing.assert_close(got[0], x[0])
    torch.testing.assert_close(got.norm(dim=-1), x.norm(dim=-1))


def test_yarn_frequencies_deepseek_v32() -> None:
    """DeepSeek-V3.2 constants: dims i <= 10 keep theta^(-2i/64), i >= 23 are divided by 40, ramp between."""
    config = ModelConfig.from_json(CONFIGS / "deepseek-v3.2.json")
    rope = config.rope
    base = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    freqs = inverse_frequencies(rope, 64)
    torch.testing.assert_close(freqs[:11], base[:11], rtol=0, atol=0)
    torch.testing.assert_close(freqs[23:], base[23:] / 40, rtol=1e-15, atol=0)
    for i in range(11, 23):
        ramp = (i - 10) / (23 - 10)
        assert freqs[i].item() == pytest.approx(base[i].item() * (1 - ramp) + base[i].item() / 40 * ramp, rel=1e-12)
    assert rope.cos_sin_factor() == 1.0
    assert yarn_mscale(40.0) == pytest.approx(0.1 * math.log(40) + 1)
    assert config.softmax_scale == pytest.approx(0.135234, abs=1e-6)
    assert config.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)


def test_yarn_matches_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for params in (
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
         "mscale": 1.0, "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "original_max_position_embeddings": 2048},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
         "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
    ):
        hf = transformers.DeepseekV32Config(max_position_embeddings=8192 * 4, rope_parameters=dict(params))
        hf_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = ModelConfig.from_dict(hf.to_dict())
        torch.testing.assert_close(inverse_frequencies(ours.rope, 64).float(), hf_freq, rtol=1e-6, atol=0)
        assert ours.rope.cos_sin_factor() == pytest.approx(hf_factor, rel=1e-12)


def test_legacy_rope_scaling_equals_rope_parameters() -> None:
    raw = json.loads((CONFIGS / "tiny-dsa.json").read_text())
    modern = ModelConfig.from_dict(raw)
    legacy_raw = dict(raw)
    params = dict(legacy_raw.pop("rope_parameters"))
    legacy_raw["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    legacy_raw["rope_scaling"] = params
    legacy = ModelConfig.from_dict(legacy_raw)
    assert legacy.rope == modern.rope
    assert legacy.softmax_scale == modern.softmax_scale
    assert modern.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(4.0) + 1) ** 2)
    # No scaling at all: plain RoPE, plain 1/sqrt(d) scale.
    plain = ModelConfig.from_dict({**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert plain.softmax_scale == pytest.approx(192**-0.5)
    assert plain.rope.cos_sin_factor() == 1.0


def test_config_derived_sizes() -> None:
    tiny = ModelConfig.from_json(CONFIGS / "tiny-dsa.json")
    assert tiny.kv_row_dim == 576 and tiny.qk_head_dim == 192
    assert [tiny.is_moe_layer(i) for i in range(tiny.num_layers)] == [False, True, True]
    bench = ModelConfig.from_json(CONFIGS / "dsv32-bench.json")
    assert (bench.num_attention_heads, bench.q_lora_rank, bench.hidden_size) == (128, 1536, 7168)
    assert (bench.index_n_heads, bench.index_head_dim, bench.index_topk) == (64, 128, 2048)
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict({"model_type": "llama"})
    # Written back as config.json, a config reads the same (and by name / file path through load_config).
    assert ModelConfig.from_dict(tiny.to_hf_dict()) == tiny
    from decode_server.model import load_config

    assert load_config("dsv32-bench") == bench == load_config(CONFIGS / "dsv32-bench.json")
