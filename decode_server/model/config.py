"""Model configuration read from a Hugging Face style `config.json` (`model_type` `deepseek_v32` or
`glm_moe_dsa`).

Field names follow the checkpoints' `config.json` (and transformers' `DeepseekV32Config` / `GlmMoeDsaConfig`) so
a real checkpoint's file loads unchanged. GLM-5 (`glm_moe_dsa`) is the same architecture with its own default
sizes, interleaved RoPE in the indexer, and cross-layer top-k sharing: `indexer_types[i]` is "full" (layer i runs
its indexer) or "shared" (it reuses the previous full layer's top-k and has no indexer), given directly, as
`index_topk_pattern` ("FSS..." or a list) or as the `index_topk_freq` / `index_skip_topk_offset` schedule, read
the way transformers 5 reads them. RoPE parameters come either from `rope_parameters` (transformers ≥ 5) or from the legacy
pair `rope_theta` + `rope_scaling` (older configs, including DeepSeek's own); both normalize to `RopeConfig`.
Derived quantities (absorbed row size, softmax scale with the YaRN mscale correction) live here so every user
computes them the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
ARCHITECTURES = {"deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}

# transformers' GlmMoeDsaConfig defaults where they differ from DeepSeek-V3.2's (used for keys a config omits).
GLM_MOE_DSA_DEFAULTS: dict[str, Any] = {
    "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288, "num_hidden_layers": 78,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 2048, "v_head_dim": 256,
    "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5, "index_n_heads": 32,
}
INDEXER_TYPES = ("full", "shared")


def parse_indexer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Per-layer "full" / "shared", as transformers' GlmMoeDsaConfig derives it: `indexer_types`, else
    `index_topk_pattern` ("F"/"S" string or list), else layer i is full iff max(i - offset + 1, 0) % freq == 0
    (`index_topk_freq` default 1: every layer full; `index_skip_topk_offset` default 2)."""
    if raw.get("indexer_types") is not None:
        return tuple(raw["indexer_types"])
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            letters = {"F": "full", "S": "shared"}
            if any(c not in letters for c in pattern):
                raise ValueError(f"index_topk_pattern {pattern!r} may only contain 'F' (full) and 'S' (shared)")
            return tuple(letters[c] for c in pattern)
        return tuple(pattern)
    freq = max(int(raw.get("index_topk_freq") or 1), 1)
    offset = int(raw.get("index_skip_topk_offset", 2))
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1·mscale·ln(factor) + 1 (1 when the context is not stretched)."""
    if factor <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeConfig:
    """Normalized rotary-embedding parameters (only `default` and `yarn` exist in DeepSeek-V3.x checkpoints)."""

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, raw: dict[str, Any], max_position_embeddings: int) -> RopeConfig:
        """Normalize `rope_parameters` / legacy `rope_scaling` (+ `rope_theta`) the way transformers reads them."""
        params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
        if rope_type == "default":
            return cls(rope_type="default", rope_theta=theta)
        if rope_type != "yarn":
            raise ValueError(f"unsupported rope_type {rope_type!r} (DeepSeek-V3.2 uses 'default' or 'yarn')")
        original = int(
            params.get("original_max_position_embeddings")
            or raw.get("original_max_position_embeddings")
            or max_position_embeddings
        )
        factor = params.get("factor")
        factor = float(factor) if factor is not None else max_position_embeddings / original
        return cls(
            rope_type="yarn",
            rope_theta=theta,
            factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=_optional_float(params.get("mscale")),
            mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
            attention_factor=_optional_float(params.get("attention_factor")),
            truncate=bool(params.get("truncate", True)),
        )

    def cos_sin_factor(self) -> float:
        """Factor applied to cos/sin (so to both rotated halves), as transformers' YaRN does.

        With DeepSeek's own configs (mscale == mscale_all_dim) this is exactly 1; the MLA magnitude correction
        then lives entirely in the softmax scale (`ModelConfig.softmax_scale`).
        """
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        if self.rope_type == "yarn":
            out.update(
                factor=self.factor,
                original_max_position_embeddings=self.original_max_position_embeddings,
                beta_fast=self.beta_fast,
                beta_slow=self.beta_slow,
            )
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class ModelConfig:
    """All fields of a DeepSeek-V3.2 `config.json` that change the computation, plus derived sizes."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    first_k_dense_replace: int = 3
    mlp_layer_types: tuple[str, ...] = ()
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 64
    indexer_types: tuple[str, ...] = ()  # per layer "full" / "shared"; () = every layer full
    indexer_rope_interleave: bool = False  # GLM-5: interleaved pairs; DeepSeek-V3.2: half-split
    rope: RopeConfig = field(default_factory=RopeConfig)
    quantization_config: dict[str, Any] | None = None
    model_type: str = "deepseek_v32"
    torch_dtype: str | None = None

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "deepseek_v32")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; expected one of {SUPPORTED_MODEL_TYPES}")
        glm = model_type == "glm_moe_dsa"
        if glm:
            raw = {**GLM_MOE_DSA_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}
        special = {"rope", "mlp_layer_types", "torch_dtype", "indexer_types", "indexer_rope_interleave"}
        names = {f.name for f in cls.__dataclass_fields__.values()} - special
        kwargs: dict[str, Any] = {k: raw[k] for k in names if k in raw and raw[k] is not None}
        if "num_experts" in raw and "n_routed_experts" not in raw:
            kwargs["n_routed_experts"] = raw["num_experts"]
        if raw.get("q_lora_rank") is None and "q_lora_rank" in raw:
            raise ValueError("q_lora_rank is null: DeepSeek-V3.2 needs the query latent (the indexer reads it)")
        max_pos = int(raw.get("max_position_embeddings", cls.max_position_embeddings))
        cfg = cls(
            **kwargs,
            rope=RopeConfig.from_hf(raw, max_pos),
            mlp_layer_types=tuple(raw.get("mlp_layer_types") or ()),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            indexer_types=parse_indexer_types(raw, int(kwargs.get("num_hidden_layers", cls.num_hidden_layers))),
            indexer_rope_interleave=bool(raw.get("indexer_rope_interleave", glm)),
        )
        cfg.validate()
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        with path.open() as fh:
            return cls.from_dict(json.load(fh))

    def validate(self) -> None:
        if self.scoring_func != "sigmoid":
            raise ValueError(f"scoring_func {self.scoring_func!r} is not supported (DeepSeek-V3.2 uses 'sigmoid')")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {self.topk_method!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (expected 'silu')")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > (self.n_routed_experts // self.n_group) * self.topk_group:
            raise ValueError("num_experts_per_tok exceeds the experts available in topk_group groups")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim must be even and fit inside index_head_dim")
        if self.mlp_layer_types and len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("mlp_layer_types must have one entry per layer")
        if self.indexer_types:
            if len(self.indexer_types) != self.num_hidden_layers:
                raise ValueError(f"indexer_types has {len(self.indexer_types)} entries for "
                                 f"{self.num_hidden_layers} layers")
            bad = sorted({t for t in self.indexer_types if t not in INDEXER_TYPES})
            if bad:
                raise ValueError(f"indexer_types entries must be 'full' or 'shared', got {bad}")
            if self.indexer_types[0] != "full":
                raise ValueError("indexer_types[0] must be 'full': a shared layer reuses a previous full layer's top-k")

    # ---- derived quantities -------------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_row_dim(self) -> int:
        """Values cached per token per layer: [c_kv (kv_lora_rank) ; k_pe (qk_rope_head_dim)] = 576."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)² under YaRN (0.135234 for DeepSeek-V3.2)."""
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def index_weight_scale(self) -> float:
        """Folded into the indexer head weights: index_n_heads^-0.5 · index_head_dim^-0.5."""
        return self.index_n_heads**-0.5 * self.index_head_dim**-0.5

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def is_index_layer(self, layer_id: int) -> bool:
        """Whether the layer runs its own indexer ("full"); "shared" layers reuse the previous full layer's."""
        return not self.indexer_types or self.indexer_types[layer_id] == "full"

    @property
    def index_layer_ids(self) -> tuple[int, ...]:
        """Layers that run the indexer, hence own indexer weights and indexer-key cache."""
        return tuple(i for i in range(self.num_hidden_layers) if self.is_index_layer(i))

    def is_moe_layer(self, layer_id: int) -> bool:
        if self.mlp_layer_types:
            return self.mlp_layer_types[layer_id] == "sparse"
        return layer_id >= self.first_k_dense_replace

    @property
    def weight_block_size(self) -> tuple[int, int]:
        block = (self.quantization_config or {}).get("weight_block_size") or [128, 128]
        return int(block[0]), int(block[1])

    def to_hf_dict(self) -> dict[str, Any]:
        """A `config.json` dict that both this loader and transformers read."""
        data = asdict(self)
        data.pop("rope")
        data.pop("torch_dtype")
        data["mlp_layer_types"] = list(self.mlp_layer_types) or None
        data["indexer_types"] = list(self.indexer_types) or None
        if self.model_type != "glm_moe_dsa":
            data.pop("indexer_rope_interleave")  # DeepSeek-V3.2's indexer is half-split, not configurable
        if data["quantization_config"] is None:
            data.pop("quantization_config")
        data["rope_parameters"] = self.rope.to_hf()
        data["architectures"] = [ARCHITECTURES[self.model_type]]
        data["head_dim"] = self.qk_rope_head_dim
        return {k: v for k, v in data.items() if v is not None or k in ("pad_token_id",)}
