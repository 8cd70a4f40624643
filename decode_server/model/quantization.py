"""Weight quantization: what a checkpoint's `quantization_config` says, which tensors it stores in FP8, and whether
the engine keeps them in FP8 (`--quantization fp8|none`, SGLang's flag).

DeepSeek-V3 / V3.2 store their weights as FP8 e4m3 with 128×128 block scales (`quantization_config`:
`{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], ...}`; GLM-5-FP8 follows the same
convention). FP8 are the linear projections: attention (`q_a_proj`, `q_b_proj`, `kv_a_proj_with_mqa`,
`kv_b_proj`, `o_proj`), the indexer's `wq_b` and `wk`, and every MLP (dense layers, shared and routed experts:
`gate_proj`, `up_proj`, `down_proj`); each `X.weight` [out, in] comes with an fp32 `X.weight_scale_inv`
[ceil(out/128), ceil(in/128)] (decode_server/model/fp8.py). The embedding, `lm_head`, the MoE router
(`mlp.gate.weight`, `e_score_correction_bias`), the indexer's `weights_proj`, norms and biases are not FP8
(docs/model.md; /work/shared/reference/dsa_flashmla.md §7).

The default of `--quantization` is the checkpoint's own: FP8 when `quant_method` is `fp8`. On CPU the weights are
always dequantized to the model dtype (the loader's path), whatever the flag says. This module is the one place
both the server and the memory planner (`decode-server plan`) take that rule from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

Quantization = Literal["fp8"]
QUANTIZATION_CHOICES = ("fp8", "none")

# Module names whose `.weight` a DeepSeek-style FP8 checkpoint stores in FP8 (with `.weight_scale_inv`).
FP8_PROJECTIONS = frozenset({
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",  # attention
    "wq_b", "wk",  # the indexer's (its `weights_proj` stays bf16)
    "gate_proj", "up_proj", "down_proj",  # dense MLP, shared and routed experts (`mlp.gate` is the router)
})


def checkpoint_quantization(config_json: Mapping[str, Any] | Any) -> Quantization | None:
    """"fp8" when the checkpoint's `quantization_config` has `quant_method` fp8, None when it has none.

    `config_json`: the config.json dict, or an object with a `quantization_config` attribute (`ModelConfig`).
    Other quantization methods are refused with a ValueError (the loader reads FP8 block-scaled and unquantized
    checkpoints only)."""
    if isinstance(config_json, Mapping):
        quant = config_json.get("quantization_config")
    else:
        quant = getattr(config_json, "quantization_config", None)
    if not quant:
        return None
    method = str(quant.get("quant_method", "")).lower()
    if method == "fp8":
        return "fp8"
    raise ValueError(f"quantization_config quant_method {method!r} is not supported: this server reads FP8 "
                     "block-scaled checkpoints (quant_method fp8, DeepSeek's format) and unquantized ones")


def resolve_quantization(requested: str | None, checkpoint: Quantization | None, device_type: str) -> Quantization | None:
    """Whether the engine keeps FP8 weights in FP8: `requested` is `--quantization` ("fp8", "none", or None for
    the checkpoint's own), `checkpoint` what `checkpoint_quantization` says. CPU always dequantizes (None).
    Asking for fp8 on a checkpoint that is not stored in FP8 is refused (no online quantization)."""
    if requested not in (None, *QUANTIZATION_CHOICES):
        raise ValueError(f"--quantization must be one of {QUANTIZATION_CHOICES}, got {requested!r}")
    if requested == "fp8" and checkpoint != "fp8":
        raise ValueError("--quantization fp8 needs a checkpoint stored in FP8 (config.json quantization_config "
                         "quant_method fp8); this one is not")
    if device_type != "cuda" or requested == "none":
        return None
    return checkpoint


def is_fp8_weight(name: str) -> bool:
    """Whether a DeepSeek-style FP8 checkpoint stores state-dict tensor `name` in FP8 (with block scales)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and module.rpartition(".")[2] in FP8_PROJECTIONS
