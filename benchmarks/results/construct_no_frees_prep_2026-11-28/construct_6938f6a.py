# ruff: noqa  -- decode_server/model/construct.py as committed in 6938f6a (module by module, freed segments handed back), imported by mem.py as the 'old' construction
"""Building a `DSAForCausalLM` without paying for PyTorch's default initialization.

The module tree is created on the meta device, cast to the target dtype (a few tensors stay float32), then
given uninitialized storage on the target device; the loader or `build_random_model` fills every tensor.
Non-persistent buffers (RoPE frequencies, Hadamard matrix) are recomputed since meta tensors carry no data.

With tensor parallelism (`parallel`) the module tree is one rank's shard; `build_random_model` still draws the
full model's random tensors in the same order and keeps this rank's slice of each, so a TP=N model holds exactly
the pieces of the TP=1 model built from the same seed.

Block-FP8 storage (decode_server/model/quantization.py): the chosen projections are turned into FP8 weights + block
scales on the meta device, before storage exists, so an FP8 model never holds a wider copy of its weights;
`build_random_model(..., quantization="fp8")` draws FP8 values and block scales directly on the device. The MoE's
routed experts get one stacked storage per projection at build time (`MoE.stack_experts`): the loader and the
random fill write through the experts' views, so the grouped GEMM's stacked weights never need a second copy. Each
attention layer's input projections (q_a, the indexer's wk, kv_a) get one stacked storage the same way
(`MLAAttention.fuse_input_projections`), so they run as one GEMM, and so do its query latent's (q_b, the indexer's
wq_b: `MLAAttention.fuse_query_projections`) and the gate and up projections of the dense
and shared-expert MLPs (`MLP.fuse_gate_up`).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from decode_server.model.attention import MLAAttention
from decode_server.model.config import ModelConfig
from decode_server.model.fp8 import dequantize_block_fp8
from decode_server.model.layers import MLP
from decode_server.model.model import DSAForCausalLM
from decode_server.model.moe import MoE
from decode_server.model.quantization import (
    FP8_BLOCK,
    FP8_DTYPE,
    SCALE_SUFFIX,
    check_mode,
    checkpoint_block,
    is_fp8_projection,
    is_fp8_state,
    model_quantization,
    random_fp8_,
    use_fp8_storage,
)
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
    parallel: ParallelState | None = None, fp8: bool | Collection[str] = False,
) -> DSAForCausalLM:
    """A model (one rank's shard with `parallel`) whose parameters have storage of the right dtype on `device`
    but undefined values. Sizes that do not split across the ranks raise ValueError here.

    `fp8`: True stores every FP8 projection (quantization.FP8_PROJECTIONS) as block FP8, a collection of weight
    names stores those; tensor-parallel pieces that cut through a block raise quantization.Fp8LayoutError."""
    device = torch.device(device)
    dtype = resolve_dtype(dtype, device)
    with torch.device("meta"):
        model = DSAForCausalLM(config, parallel)
    if fp8 is True or (fp8 and not isinstance(fp8, bool)):
        use_fp8_storage(model, None if fp8 is True else fp8, _fp8_block(config))
    for name, tensor in list(model.state_dict(keep_vars=True).items()):
        if is_fp8_state(name, tensor):
            continue
        tensor.data = tensor.data.to(torch.float32 if keeps_float32(name) else dtype)
    # Storage is given module by module, each stacking module's stacks made right after its own tensors, and the
    # segments its replaced parameters leave wholly free handed back at once (`_release_freed`): the allocator
    # reuses the partly freed blocks for the next layers, and no later, smaller allocation splits a freed segment
    # and strands the rest of it. Giving the whole model storage first stranded ~5 MB a layer (each freed kv_a
    # inside a segment live tensors also hold), and absorbed copies allocated after loading landed in the freed
    # 14 MiB segments of the shared experts' gate and up: 666-734 MiB on an EP8 rank of GLM-5 / DeepSeek-V3.2
    # that the KV budget, measured from free device memory, never got (tests/model/test_construct_memory_gpu.py).
    materialized: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.inv_freq = inverse_frequencies(config.rope, module.dim).to(device)
        elif isinstance(module, MoE):
            materialize_(module, device, materialized)
            module.stack_experts()
            _release_freed(device)
        elif isinstance(module, MLAAttention):
            materialize_(module, device, materialized)
            module.fuse_input_projections(copy=False)
            module.fuse_query_projections(copy=False)
            _release_freed(device)
            module.reserve_absorbed()
        elif isinstance(module, MLP):
            materialize_(module, device, materialized)
            module.fuse_gate_up(copy=False)  # dense and shared-expert MLPs (routed experts opt out)
            _release_freed(device)
    materialize_(model, device, materialized)
    model.quantization = model_quantization(model)
    model.eval()
    return model


def materialize_(module: torch.nn.Module, device: torch.device,
                 done: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Give every meta parameter and buffer of `module`'s tree uninitialized storage on `device` (what
    `Module.to_empty` does, but tensors that already have storage — stacks and their views — are left alone).
    `done` maps a meta tensor's id to (that tensor, kept alive so the id stays its own; its replacement), so a
    tensor shared by two modules stays shared."""
    if device.type == "meta":
        return
    for sub in module.modules():
        for table, make in ((sub._parameters, _empty_parameter), (sub._buffers, torch.empty_like)):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in done:
                    done[id(tensor)] = (tensor, make(tensor, device=device))
                table[name] = done[id(tensor)][1]


def _release_freed(device: torch.device) -> None:
    """Hand the caching allocator's wholly free segments back to the driver (after a stack replaced parameters)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _empty_parameter(param: torch.Tensor, device: torch.device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty_like(param, device=device), requires_grad=param.requires_grad)


def _fp8_block(config: ModelConfig) -> tuple[int, int]:
    """The checkpoint's block, or 128×128 for models without a quantization_config (random FP8 models)."""
    return checkpoint_block(config) or (128, 128)


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
    """Fill every tensor of the state dict deterministically (unit-gain Gaussians, norms = 1). FP8 weights get
    random FP8 values and block scales with the same standard deviation (quantization.random_fp8_), drawn on
    the device."""
    if model.parallel.tp_size > 1:
        _randomize_shard(model, seed)
        return
    device = model.device
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    state = model.state_dict(keep_vars=True)
    for name, tensor in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue  # filled with its weight
        std = _init_std(name, tensor.shape, model.config)
        if std is None:
            tensor.data.fill_(1.0)
            continue
        if tensor.dtype == FP8_DTYPE:
            random_fp8_(tensor.data, state[name + SCALE_SUFFIX].data, std, generator)
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
    fp8_model = model_quantization(model) == "fp8"
    for name, shape in full_state_shapes(model.config).items():
        std = _init_std(name, shape, model.config)
        tensor = local.get(name)
        if std is None:
            if tensor is not None:
                tensor.data.fill_(1.0)
            continue
        # Other ranks' experts are FP8 too in an FP8 model: draw them in the same form to keep the generator in step.
        if (tensor is not None and tensor.dtype == FP8_DTYPE) or (tensor is None and fp8_model
                                                                 and is_fp8_projection(name)):
            values, scales = random_fp8_(torch.empty(0, device=device), torch.empty(0, device=device), std,
                                         generator, full_weight_shape=shape)
            if tensor is not None:
                tensor.data.copy_(piece(values, shards.get(name)))
                local[name + SCALE_SUFFIX].data.copy_(piece(scales, shards.get(name + SCALE_SUFFIX)))
            continue
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if tensor is not None:
            tensor.data.copy_(piece(noise, shards.get(name)).mul_(std))
    model.finalize_weights()


def build_random_model(
    config: ModelConfig, device: torch.device | str, dtype: torch.dtype | str | None = None, seed: int = 0,
    parallel: ParallelState | None = None, quantization: str | None = "none",
) -> DSAForCausalLM:
    """Random weights created directly on `device` (no checkpoint): for benchmarks at real layer sizes.
    With `parallel`, this rank's slice of the same weights the single-device model gets from `seed`.
    `quantization`: "none" (the model dtype), "fp8" (every FP8 projection as random block FP8, drawn on the
    device), "auto" (fp8 on CUDA when the config's quantization_config says block FP8)."""
    mode = check_mode(quantization)
    device = torch.device(device)
    fp8 = mode == "fp8" or (mode == "auto" and device.type == "cuda" and checkpoint_block(config) is not None)
    model = build_empty_model(config, device, dtype, resolve(parallel), fp8=fp8)
    randomize_weights(model, seed)
    return model


@torch.no_grad()
def dequantized_copy(model: DSAForCausalLM) -> DSAForCausalLM:
    """The same model with every FP8 weight dequantized to the model dtype (the `--quantization none` model of
    the same weights): built like `model`, filled from its tensors."""
    target = build_empty_model(model.config, model.device, model.dtype, model.parallel)
    source = model.state_dict()
    for name, tensor in target.state_dict(keep_vars=True).items():
        value = source[name]
        scale = source.get(name + SCALE_SUFFIX)
        if value.dtype == FP8_DTYPE and scale is not None:
            block = _fp8_block_of(model, name)
            value = dequantize_block_fp8(value, scale, block)
        tensor.data.copy_(value.to(tensor.dtype))
    target.finalize_weights()
    return target


def _fp8_block_of(model: DSAForCausalLM, weight_name: str) -> tuple[int, int]:
    module = model.get_submodule(weight_name[: -len(".weight")])
    return getattr(module, "weight_block", FP8_BLOCK)
