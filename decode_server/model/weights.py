"""How many bytes a model's weights hold on their device: what a loaded model holds (`weight_bytes`, the engine
reports it) and what one GPU of a deployment will hold, from the config alone (`planned_weight_bytes`, the memory
planner's). One count serves both (`weight_storages`), so they agree by construction: the planner builds the very
module tree the engine builds (`build_empty_model`, with the same `fp8=` choice of FP8 projections) on the meta
device, where nothing is allocated, and counts it the same way.

Every parameter and buffer is counted once per storage (tied embeddings, the experts' views into their stacked
storage), whole storages (a view's unused part is still memory). Kinds:
  - "fp8": block-FP8 weights (1 byte per value);
  - "fp8_scales": their float32 `weight_scale_inv` (4 bytes per 128×128 block);
  - "absorbed": the MLA absorbed W_UK / W_UV that live beside kv_b_proj: in the model dtype (unquantized
    models, and FP8 kv_b_proj whose heads cut through 128-blocks: GLM-5), or with FP8 storage whose heads are whole
    blocks (DeepSeek-V3.2) only the FP8 W_UKᵀ copy and its scales — W_UV there is a view of kv_b_proj's own FP8 rows
    and scales, counted once, under "fp8" / "fp8_scales" (decode_server/model/attention.py `absorb_weights`);
  - "other": everything else (embeddings, LM head, norms, router and indexer weights_proj in float32, weights
    stored in the model dtype, RoPE and Hadamard buffers).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections import Counter
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from decode_server.model.config import ModelConfig
from decode_server.model.quantization import SCALE_SUFFIX

KINDS = ("fp8", "fp8_scales", "absorbed", "other")
ABSORBED_NAMES = ("w_uk", "w_uv", "w_uk_scale", "w_uv_scale")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _kind(name: str, tensor: torch.Tensor) -> str:
    if name.endswith(ABSORBED_NAMES):
        return "absorbed"
    if tensor.dtype == torch.float8_e4m3fn:
        return "fp8"
    if name.endswith("weight_scale_inv"):
        return "fp8_scales"
    return "other"


def _storage_key(tensor: torch.Tensor, storage: torch.UntypedStorage) -> tuple:
    """Tensors on the same memory share a key. On the meta device every storage's address is 0, so there the key
    is the storage object itself (its C++ StorageImpl, which views of one tensor share: the experts' stacked
    weights count once, as on a real device)."""
    if tensor.device.type == "meta":
        return ("meta", storage._cdata)
    return (tensor.device, storage.data_ptr())


def weight_storages(model: nn.Module) -> Iterator[tuple[str, str, int]]:
    """(name, kind, bytes) of each storage the model's parameters and buffers hold, once each, under the first
    name that holds it (state-dict order)."""
    seen: set[tuple] = set()
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        storage = tensor.untyped_storage()
        key = _storage_key(tensor, storage)
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        yield name, _kind(name, tensor), storage.nbytes()


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """{"total": bytes, "fp8": …, "fp8_scales": …, "absorbed": …, "other": …} of the model's tensors."""
    out = dict.fromkeys(KINDS, 0)
    for _, kind, nbytes in weight_storages(model):
        out[kind] += nbytes
    out["total"] = sum(out[k] for k in KINDS)
    return out


# -- one GPU of a deployment, from the config (the memory planner) -------------------------------------------------

@dataclass(frozen=True)
class WeightBytes:
    """One GPU's weights: total bytes, bytes per kind (`KINDS`), the parameter count (elements of the parameters,
    FP8 block scales and derived buffers not included) and whether any weight is stored in FP8."""

    total: int
    parameters: int
    by_kind: dict[str, int] = field(default_factory=dict)

    @property
    def quantization(self) -> str:
        """"fp8" when some weight is stored in FP8, else "none" (as `model.quantization` says of a loaded model)."""
        return "fp8" if self.by_kind.get("fp8") else "none"


@dataclass(frozen=True)
class _Reduced:
    """A config with one decoder layer per kind; for each of its layers, how many layers of the real model it
    stands for, and the FP8 projections it is built with (the reduced model's names)."""

    config: ModelConfig
    repeats: list[int]
    fp8: bool | set[str]


def _one_layer_per_kind(config: ModelConfig, fp8: bool | Collection[str]) -> _Reduced:
    """Layers of one kind are built identically (a layer's id only names its tensors); with FP8 projections given
    by name (a checkpoint's), a layer's kind also says which of its projections are FP8, so a checkpoint that
    stores some layers differently is still counted exactly."""
    by_layer: dict[int, set[str]] = {}
    if not isinstance(fp8, bool):
        for name in fp8:
            match = _LAYER.match(name)
            if match is not None:
                by_layer.setdefault(int(match.group(1)), set()).add(name[match.end():])
    counts: Counter[tuple[bool, bool, frozenset[str]]] = Counter()
    for layer in range(config.num_hidden_layers):
        counts[(config.is_moe_layer(layer), config.is_index_layer(layer), frozenset(by_layer.get(layer, ())))] += 1
    kinds = sorted(counts, key=lambda kind: not kind[1])  # full-indexer layers first: a shared one needs one before
    reduced = dataclasses.replace(
        config, num_hidden_layers=len(kinds),
        mlp_layer_types=tuple("sparse" if moe else "dense" for moe, _, _ in kinds),
        indexer_types=tuple("full" if full else "shared" for _, full, _ in kinds),
    )
    names: bool | set[str] = fp8 if isinstance(fp8, bool) else {
        name for name in fp8 if _LAYER.match(name) is None} | {
        f"model.layers.{i}.{suffix}" for i, (_, _, suffixes) in enumerate(kinds) for suffix in suffixes}
    return _Reduced(reduced, [counts[k] for k in kinds], names)


def planned_weight_bytes(
    config: ModelConfig, dtype: torch.dtype, tp_size: int = 1, ep_size: int = 1,
    fp8: bool | Collection[str] = False, dp_size: int = 1,
) -> WeightBytes:
    """What one GPU of a `tp_size` × `ep_size` deployment holds, from the config alone (nothing is allocated);
    `dp_size` = `tp_size`: data-parallel attention (attention replicated whole on every rank).

    `fp8` is `build_empty_model`'s: True stores every FP8 projection (quantization.FP8_PROJECTIONS) as block FP8,
    a collection of weight names (the real model's, as the loader picks them from a checkpoint) stores those;
    a tensor-parallel piece that cuts through a 128-block raises quantization.Fp8LayoutError, as in the engine.

    The module tree is built on the meta device with one decoder layer per kind (dense or MoE, full or shared
    indexer, and which projections are FP8) and each layer's bytes are multiplied by the number of layers of its
    kind (building all 61 layers of DeepSeek-V3.2 with 256 experts each takes tens of seconds). Every rank holds
    the same bytes (FP8 pieces start and end on block edges, or FP8 storage is refused)."""
    # Imported here: construct imports the model, which imports the engine's forward context.
    from decode_server.model.construct import build_empty_model
    from decode_server.parallel.state import ParallelState

    reduced = _one_layer_per_kind(config, fp8)
    model = build_empty_model(reduced.config, "meta", dtype, ParallelState(tp_rank=0, tp_size=tp_size,
                                                                           ep_size=ep_size, dp_size=dp_size),
                               fp8=reduced.fp8)
    model.finalize_weights()  # derived tensors: the absorbed MLA matrices (and the tied head, if any)
    by_kind: Counter[str] = Counter(dict.fromkeys(KINDS, 0))
    for name, kind, nbytes in weight_storages(model):
        by_kind[kind] += _repeats(name, reduced) * nbytes
    parameters = sum(_repeats(name, reduced) * p.numel() for name, p in model.named_parameters()
                     if not name.endswith(SCALE_SUFFIX))
    return WeightBytes(total=sum(by_kind.values()), parameters=parameters, by_kind=dict(by_kind))


def _repeats(name: str, reduced: _Reduced) -> int:
    layer = _LAYER.match(name)
    return reduced.repeats[int(layer.group(1))] if layer else 1
