"""How many bytes a model's weights really hold on their device (the engine reports it; the memory planner is
checked against it).

Every parameter and buffer is counted once per storage (tied embeddings, the experts' views into their stacked
storage), whole storages (a view's unused part is still memory). Kinds:
  - "fp8": block-FP8 weights (1 byte per value);
  - "fp8_scales": their float32 `weight_scale_inv` (4 bytes per 128×128 block);
  - "absorbed": the MLA absorbed W_UK / W_UV, kept in the model dtype next to kv_b_proj (bf16 even with FP8
    storage, as SGLang keeps them);
  - "other": everything else (embeddings, LM head, norms, router and indexer weights_proj in float32, weights
    stored in the model dtype, RoPE and Hadamard buffers).
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

KINDS = ("fp8", "fp8_scales", "absorbed", "other")


def _kind(name: str, tensor: torch.Tensor) -> str:
    if tensor.dtype == torch.float8_e4m3fn:
        return "fp8"
    if name.endswith("weight_scale_inv"):
        return "fp8_scales"
    if name.endswith(("w_uk", "w_uv")):
        return "absorbed"
    return "other"


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """{"total": bytes, "fp8": …, "fp8_scales": …, "absorbed": …, "other": …} of the model's tensors."""
    seen: set[tuple[torch.device, int]] = set()
    out = dict.fromkeys(KINDS, 0)
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        out[_kind(name, tensor)] += storage.nbytes()
    out["total"] = sum(out[k] for k in KINDS)
    return out
