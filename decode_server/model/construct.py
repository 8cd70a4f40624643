"""Building a `DSAForCausalLM` without paying for PyTorch's default initialization.

The module tree is created on the meta device, cast to the target dtype (a few tensors stay float32), then
given uninitialized storage on the target device; the loader or `build_random_model` fills every tensor.
Non-persistent buffers (RoPE frequencies, Hadamard matrix) are recomputed since meta tensors carry no data.

With tensor parallelism (`parallel`) the module tree is one rank's shard; `build_random_model` still draws the
full model's random tensors in the same order and keeps this rank's slice of each, so a TP=N model holds exactly
the pieces of the TP=1 model built from the same seed.
"""

from __future__ import annotations

import math

import torch

from decode_server.model.config import ModelConfig
from decode_server.model.indexer import Indexer, hadamard_matrix
from decode_server.model.model import DSAForCausalLM
from decode_server.model.rope import RotaryEmbedding, inverse_frequencies
from decode_server.parallel.layers import Shard, parameter_shards
from decode_server.parallel.state import ParallelState, resolve

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


def full_state_shapes(config: ModelConfig) -> dict[str, torch.Size]:
    """State-dict names and shapes of the whole (single-device) model, in state-dict order; built on the meta
    device, so it costs no memory."""
    with torch.device("meta"):
        model = DSAForCausalLM(config)
    return {name: tensor.shape for name, tensor in model.state_dict(keep_vars=True).items()}


def piece(tensor: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """This rank's piece of a full tensor (the tensor itself when replicated)."""
    if shard is None:
        return tensor
    start, stop = shard.bounds(tensor.shape[shard.dim])
    return tensor.narrow(shard.dim, start, stop - start)


def build_empty_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype | str | None = None,
    parallel: ParallelState | None = None,
) -> DSAForCausalLM:
    """A model (one rank's shard with `parallel`) whose parameters have storage of the right dtype on `device`
    but undefined values. Sizes that do not split across the ranks raise ValueError here."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DSAForCausalLM(config, parallel)
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
    if model.parallel.tp_size > 1:
        _randomize_shard(model, seed)
        return
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


def _randomize_shard(model: DSAForCausalLM, seed: int) -> None:
    """One rank's pieces of the tensors `randomize_weights` draws for the whole model: the full tensors are
    drawn in the same order (other ranks' experts included, to keep the generator in step) and sliced."""
    device = model.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    local = model.state_dict(keep_vars=True)
    shards = parameter_shards(model)
    for name, shape in full_state_shapes(model.config).items():
        std = _init_std(name, shape, model.config)
        tensor = local.get(name)
        if std is None:
            if tensor is not None:
                tensor.data.fill_(1.0)
            continue
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if tensor is not None:
            tensor.data.copy_(piece(noise, shards.get(name)).mul_(std))
    model.finalize_weights()


def build_random_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype | str | None = None, seed: int = 0,
    parallel: ParallelState | None = None,
) -> DSAForCausalLM:
    """Random weights created directly on `device` (no checkpoint): for benchmarks at real layer sizes.
    With `parallel`, this rank's slice of the same weights the single-device model gets from `seed`."""
    model = build_empty_model(config, device, dtype, resolve(parallel))
    randomize_weights(model, seed)
    return model
