"""Weight memory: what a loaded model holds (`model_weight_bytes`, the engine's count) and what one GPU of a
deployment will hold, computed from the config alone (`planned_weight_bytes`, the memory planner's).

Both count every parameter and buffer of the model as the engine builds it, so they agree by construction for
the unquantized model: the planner builds the very same module tree (`build_empty_model`) on the meta device (no
memory), one tensor-parallel rank's shard, with the dtypes the engine gives each tensor, and the absorbed MLA
matrices (`w_uk`, `w_uv`, copies cut from `kv_b_proj`) included. With `quantization="fp8"` every tensor that the
checkpoint stores in FP8 (decode_server/model/quantization.py) counts 1 byte per element plus its fp32 128×128
block scales for the blocks this rank's piece touches (the loader reads exactly those); the absorbed matrices stay
in the model dtype (as SGLang keeps them).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from decode_server.model.config import ModelConfig
from decode_server.model.fp8 import scale_window
from decode_server.model.quantization import Quantization, is_fp8_weight
from decode_server.parallel.layers import Shard

FP8_SCALE_BYTES = 4  # fp32 weight_scale_inv
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _storage_key(tensor: torch.Tensor) -> tuple:
    """Tensors that are the same memory (tied weights, views of stacked experts) share a key."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return ("id", id(tensor))
    return ("ptr", tensor.data_ptr(), tensor.numel(), tensor.dtype)


def model_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer of `model` (derived ones such as the absorbed MLA matrices included),
    each piece of memory once: what the engine counts as weights (`EngineStats.weights_bytes`)."""
    seen: set[tuple] = set()
    total = 0
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        key = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


@dataclass(frozen=True)
class WeightBytes:
    """One GPU's weights: total bytes, bytes per storage kind, and the parameter count (elements of parameters,
    not of derived buffers)."""

    total: int
    parameters: int
    by_kind: dict[str, int] = field(default_factory=dict)


def _worst_piece_blocks(full: int, shard: Shard | None, block: int) -> int:
    """The most scale blocks any rank's piece of a dimension of size `full` touches."""
    if shard is None:
        return math.ceil(full / block)
    size = full // shard.count
    return max(scale_window(i * size, (i + 1) * size, block)[1] - scale_window(i * size, (i + 1) * size, block)[0]
               for i in range(shard.count))


def fp8_scale_bytes(local_shape: tuple[int, ...], shard: Shard | None, block: tuple[int, int]) -> int:
    """fp32 block-scale bytes of one rank's piece of a 2-D FP8 weight (the largest over the ranks)."""
    full = shard.full_shape(local_shape) if shard is not None else tuple(local_shape)
    rows = _worst_piece_blocks(full[0], shard if shard is not None and shard.dim == 0 else None, block[0])
    cols = _worst_piece_blocks(full[1], shard if shard is not None and shard.dim == 1 else None, block[1])
    return rows * cols * FP8_SCALE_BYTES


def layer_kinds(config: ModelConfig) -> dict[tuple[bool, bool], int]:
    """(MoE layer?, runs the indexer?) → number of layers of that kind, the kind of layer 0 first. Layers of one
    kind are built identically (a layer's id only names its tensors), so they hold the same bytes."""
    kinds: Counter[tuple[bool, bool]] = Counter()
    for layer in range(config.num_hidden_layers):
        kinds[(config.is_moe_layer(layer), config.is_index_layer(layer))] += 1
    return dict(kinds)


def _one_layer_per_kind(config: ModelConfig) -> tuple[ModelConfig, list[int]]:
    """A config with one layer of each kind (layer 0's kind first, as a shared-indexer layer needs a full one
    before it) and how many layers of the real model each stands for."""
    kinds = sorted(layer_kinds(config).items(), key=lambda item: not item[0][1])  # full-indexer layers first
    reduced = dataclasses.replace(
        config, num_hidden_layers=len(kinds),
        mlp_layer_types=tuple("sparse" if moe else "dense" for (moe, _), _ in kinds),
        indexer_types=tuple("full" if full else "shared" for (_, full), _ in kinds),
    )
    return reduced, [count for _, count in kinds]


def planned_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp_size: int = 1, ep_size: int = 1,
    quantization: Quantization | None = None,
) -> WeightBytes:
    """What one GPU of a `tp_size` × `ep_size` deployment holds, from the config alone (nothing is allocated).

    The module tree is built on the meta device with one decoder layer per kind (dense or MoE, full or shared
    indexer; `layer_kinds`) and each layer's bytes are multiplied by the number of layers of its kind (building all
    61 layers of DeepSeek-V3.2 with 256 experts each takes tens of seconds). Every rank holds the same amount except
    for FP8 block scales of pieces that do not start on a block edge; those are counted for the rank whose piece
    touches the most blocks."""
    # Imported here: construct imports the model, which imports the engine's forward context.
    from decode_server.model.construct import build_empty_model
    from decode_server.parallel.layers import parameter_shards
    from decode_server.parallel.state import ParallelState

    reduced, repeats = _one_layer_per_kind(config)
    model = build_empty_model(reduced, "meta", dtype, ParallelState(tp_rank=0, tp_size=tp_size, ep_size=ep_size))
    model.finalize_weights()  # derived tensors: the absorbed MLA matrices (and the tied head, if any)
    shards = parameter_shards(model)
    block = config.weight_block_size
    by_kind: Counter[str] = Counter()
    seen: set[int] = set()
    parameters = 0
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        layer = _LAYER.match(name)
        times = repeats[int(layer.group(1))] if layer else 1
        if isinstance(tensor, nn.Parameter):
            parameters += times * tensor.numel()
        if quantization == "fp8" and tensor.dim() == 2 and is_fp8_weight(name):
            by_kind["fp8"] += times * tensor.numel()
            by_kind["fp8 block scales"] += times * fp8_scale_bytes(tuple(tensor.shape), shards.get(name), block)
        else:
            by_kind[str(tensor.dtype).removeprefix("torch.")] += times * tensor.numel() * tensor.element_size()
    return WeightBytes(total=sum(by_kind.values()), parameters=parameters, by_kind=dict(by_kind))
