"""Building a `DSAForCausalLM` without paying for PyTorch's default initialization.

The module tree is created on the meta device, cast to the target dtype (a few tensors stay float32), then
given uninitialized storage on the target device; the loader or `build_random_model` fills every tensor.
Non-persistent buffers (RoPE frequencies, Hadamard matrix) are recomputed since meta tensors carry no data.
"""

from __future__ import annotations

import math

import torch

from decode_server.model.config import ModelConfig
from decode_server.model.indexer import Indexer, hadamard_matrix
from decode_server.model.model import DSAForCausalLM
from decode_server.model.rope import RotaryEmbedding, inverse_frequencies

# Tensors kept in float32 whatever the model dtype (router, selection bias, indexer head weights).
FP32_TENSOR_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """`None`/"auto": bfloat16 on CUDA, float32 on CPU; otherwise a torch dtype or its name."""
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float64": torch.float64}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(names)}")
    return names[dtype]


def keeps_float32(name: str) -> bool:
    return name.endswith(FP32_TENSOR_SUFFIXES)


def build_empty_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype | str | None = None
) -> DSAForCausalLM:
    """A model whose parameters have storage of the right dtype on `device` but undefined values."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DSAForCausalLM(config)
    for name, tensor in list(model.state_dict(keep_vars=True).items()):
        tensor.data = tensor.data.to(torch.float32 if keeps_float32(name) else dtype)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = inverse_frequencies(config.rope, module.dim).to(device)
        elif isinstance(module, Indexer):
            module.hadamard = hadamard_matrix(module.head_dim).to(device)
    model.eval()
    return model


def _init_std(name: str, shape: torch.Size, config: ModelConfig) -> float | None:
    """Standard deviation of a random tensor, or None for constant-initialized ones (norms, biases)."""
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return None
    if name.endswith("k_norm.bias"):
        return 0.1
    if name.endswith("e_score_correction_bias"):
        return 0.01
    if name.endswith("embed_tokens.weight"):
        return 1.0
    return 1.0 / math.sqrt(shape[-1])  # unit gain for every projection: activations stay O(1) through layers


@torch.no_grad()
def randomize_weights(model: DSAForCausalLM, seed: int) -> None:
    """Fill every tensor of the state dict deterministically (unit-gain Gaussians, norms = 1)."""
    device = model.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    for name, tensor in model.state_dict(keep_vars=True).items():
        std = _init_std(name, tensor.shape, model.config)
        if std is None:
            tensor.data.fill_(1.0)
            continue
        noise = torch.randn(tensor.shape, generator=generator, device=device, dtype=torch.float32)
        tensor.data.copy_(noise.mul_(std))
    model.finalize_weights()


def build_random_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype | str | None = None, seed: int = 0
) -> DSAForCausalLM:
    """Random weights created directly on `device` (no checkpoint): for benchmarks at real layer sizes."""
    model = build_empty_model(config, device, dtype)
    randomize_weights(model, seed)
    return model
