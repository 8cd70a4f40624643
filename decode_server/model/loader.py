"""Loading DeepSeek-V3.2 / GLM-5 safetensors checkpoints (single file or sharded) into `DSAForCausalLM`.

Tensor names are the Hugging Face ones (`model.layers.N.self_attn.indexer.wq_b.weight`, ...). FP8 e4m3 weights
either stay FP8 (block-FP8 storage, `quantization` "fp8", or "auto" on CUDA: decode_server/model/quantization.py)
— the FP8 bytes and their `weight_scale_inv` are copied as they are — or are dequantized on load with their block
`weight_scale_inv` ("none"; CPU); bf16/fp32 tensors are used as they are (cast to the model dtype). The multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) is skipped, and so are
indexer weights a checkpoint may carry for GLM-5 "shared" layers (they never run an indexer). Every
problem (missing, unexpected, mis-shaped tensor) is collected from the checkpoint's metadata before any data is
read and reported in one `CheckpointError` naming the tensors and shapes.

With tensor parallelism each rank reads only its piece of every sharded tensor (safetensors `get_slice`, which
reads just the requested bytes) and, for an FP8 piece, only the rows/columns of `weight_scale_inv` its blocks
touch (a piece's edge need not fall on a 128-block edge); with expert parallelism it skips other ranks' experts.
Replicated tensors are read whole. The checkpoint is checked against the full model's shapes either way.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from decode_server.model.config import ModelConfig
from decode_server.model.construct import build_empty_model, full_state_shapes
from decode_server.model.fp8 import dequantize_block_fp8, scale_shape, scale_window
from decode_server.model.model import DSAForCausalLM
from decode_server.model.quantization import (
    FP8_DTYPE,
    Fp8LayoutError,
    check_mode,
    checkpoint_block,
    is_fp8_projection,
    wants_fp8,
)
from decode_server.parallel.layers import Shard, parameter_shards
from decode_server.parallel.state import ParallelState

logger = logging.getLogger(__name__)

SCALE_SUFFIX = "_scale_inv"
INDEX_FILE = "model.safetensors.index.json"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_FP8_DTYPES = ("F8_E4M3",)
_MAX_REPORTED = 20


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


def checkpoint_files(path: Path) -> list[Path]:
    """Shards named by `model.safetensors.index.json`, else `model.safetensors`, else every `*.safetensors`."""
    index = path / INDEX_FILE
    if index.exists():
        with index.open() as fh:
            weight_map: dict[str, str] = json.load(fh)["weight_map"]
        files = [path / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.exists()]
        if absent:
            raise CheckpointError(f"{index} names shards that do not exist: {absent}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no safetensors files in {path}")
    return files


def _is_skipped(name: str, config: ModelConfig) -> bool:
    """MTP layers (index >= num_hidden_layers), indexers of shared layers, stale RoPE caches some exporters save."""
    match = _LAYER_RE.match(name)
    if match:
        layer = int(match.group(1))
        if layer >= config.num_hidden_layers:
            return True
        if ".self_attn.indexer." in name and not config.is_index_layer(layer):
            return True
    return name.endswith("rotary_emb.inv_freq")


def _catalog(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """name → (file, shape, safetensors dtype string), from headers only."""
    catalog: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                meta = handle.get_slice(name)
                if name in catalog:
                    raise CheckpointError(f"tensor {name} appears in both {catalog[name][0]} and {file}")
                catalog[name] = (file, tuple(meta.get_shape()), meta.get_dtype())
    return catalog


def _check(
    expected: dict[str, torch.Size], catalog: dict[str, tuple[Path, tuple[int, ...], str]], config: ModelConfig
) -> None:
    problems: list[str] = []
    block = config.weight_block_size
    for name, shape in expected.items():
        if name not in catalog:
            problems.append(f"missing tensor {name} (expected shape {tuple(shape)})")
            continue
        _, found, dtype = catalog[name]
        if found != tuple(shape):
            problems.append(f"tensor {name} has shape {found}, expected {tuple(shape)}")
            continue
        if dtype in _FP8_DTYPES:
            scale = name + SCALE_SUFFIX
            if scale not in catalog:
                problems.append(f"FP8 tensor {name} has no {scale}")
            elif catalog[scale][1] != scale_shape(found, block):
                problems.append(
                    f"tensor {scale} has shape {catalog[scale][1]}, expected {scale_shape(found, block)}"
                )
    for name, (_, shape, _) in catalog.items():
        if name in expected or _is_skipped(name, config):
            continue
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in expected:
            continue
        problems.append(f"unexpected tensor {name} (shape {shape})")
    if problems:
        more = f"\n  ... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise CheckpointError(
            f"checkpoint does not match the model ({len(problems)} problems):\n  "
            + "\n  ".join(problems[:_MAX_REPORTED]) + more
        )


@torch.no_grad()
def load_weights(model: DSAForCausalLM, path: str | Path,
                 catalog: dict[str, tuple[Path, tuple[int, ...], str]] | None = None) -> int:
    """Fill every tensor of `model` (one rank's shard with tensor parallelism) from the checkpoint directory
    `path`, then refresh derived weights. Returns the bytes read from the checkpoint. FP8 weights of layers with
    block-FP8 storage are copied as FP8 (their scales are state-dict tensors of their own); other FP8 weights are
    dequantized into their layer's dtype."""
    path = Path(path)
    config = model.config
    targets = model.state_dict(keep_vars=True)
    sharded = model.parallel.tp_size > 1
    expected = full_state_shapes(config) if sharded else {name: t.shape for name, t in targets.items()}
    if config.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    shards = parameter_shards(model)
    files = checkpoint_files(path)
    catalog = catalog if catalog is not None else _catalog(files)
    _check(expected, catalog, config)
    block = config.weight_block_size
    bytes_read = 0
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                if name not in targets:
                    continue  # skipped tensors, and other ranks' experts with expert parallelism
                shard = shards.get(name)
                window = _window(catalog[name][1], shard)
                tensor = handle.get_slice(name)[window] if shard is not None else handle.get_tensor(name)
                bytes_read += tensor.nbytes
                target = targets[name]
                if tensor.dtype == FP8_DTYPE and target.dtype != FP8_DTYPE:
                    scale, origin = _read_scale(catalog, name + SCALE_SUFFIX, window, block)
                    bytes_read += scale.nbytes
                    tensor = dequantize_block_fp8(tensor, scale, block, origin)
                elif target.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                    raise CheckpointError(f"tensor {name} is {tensor.dtype} in the checkpoint, but the model stores "
                                          "it in FP8 (its FP8 layers follow the checkpoint's FP8 tensors)")
                target.data.copy_(tensor.to(target.dtype))
    model.finalize_weights()
    logger.info("loaded %d tensors (%.1f MiB read) from %d file(s) in %s%s", len(targets), bytes_read / 2**20,
                len(files), path, _rank_note(model.parallel))
    return bytes_read


def _rank_note(parallel: ParallelState) -> str:
    if parallel.tp_size == 1:
        return ""
    dp = f", data-parallel attention over {parallel.dp_size}" if parallel.dp_attention else ""
    return f" (tensor-parallel rank {parallel.tp_rank}/{parallel.tp_size}, ep_size {parallel.ep_size}{dp})"


def _window(full_shape: tuple[int, ...], shard: Shard | None) -> tuple[slice, ...]:
    """Index of this rank's piece of a tensor of `full_shape` (everything when replicated)."""
    window = [slice(0, size) for size in full_shape]
    if shard is not None:
        window[shard.dim] = slice(*shard.bounds(full_shape[shard.dim]))
    return tuple(window)


def _read_scale(
    catalog: dict[str, tuple[Path, tuple[int, ...], str]], name: str, window: tuple[slice, ...],
    block: tuple[int, int],
) -> tuple[torch.Tensor, tuple[int, int]]:
    """The rows/cols of a (small) block-scale tensor that a piece `window` of its weight touches, and the
    piece's origin; from whichever shard file holds the scale (it may sit in another file)."""
    rows = scale_window(window[0].start, window[0].stop, block[0])
    cols = scale_window(window[1].start, window[1].stop, block[1])
    with safe_open(str(catalog[name][0]), framework="pt") as handle:
        scale = handle.get_slice(name)[rows[0] : rows[1], cols[0] : cols[1]]
    return scale, (window[0].start, window[1].start)


def stored_fp8_projections(catalog: dict[str, tuple[Path, tuple[int, ...], str]], config: ModelConfig) -> set[str]:
    """The projection weights a checkpoint stores in FP8 (2-D F8_E4M3 tensors of quantization.FP8_PROJECTIONS that
    the model has): with FP8 storage these, and only these, stay FP8 (`build_empty_model(..., fp8=names)`)."""
    return {name for name, (_, shape, dtype) in catalog.items()
            if dtype in _FP8_DTYPES and len(shape) == 2 and is_fp8_projection(name) and not _is_skipped(name, config)}


def checkpoint_fp8_projections(path: str | Path, config: ModelConfig) -> set[str]:
    """`stored_fp8_projections` of a checkpoint directory, from its safetensors headers only (no tensor is read):
    what the memory planner builds as FP8 when given a checkpoint, as the loader does."""
    return stored_fp8_projections(_catalog(checkpoint_files(Path(path))), config)


def load_checkpoint(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
    parallel: ParallelState | None = None, quantization: str | None = "auto",
) -> tuple[DSAForCausalLM, ModelConfig]:
    """Build the model (one rank's shard with `parallel`) and load it. `quantization` (decode_server/model/
    quantization.py): "auto" keeps a block-FP8 checkpoint's FP8 projections in FP8 on CUDA (dequantizing them
    instead, with a warning, when a tensor-parallel piece cuts through a block) and dequantizes elsewhere; "fp8"
    keeps them in FP8 on any device or fails; "none" dequantizes."""
    path = Path(path)
    config = ModelConfig.from_json(path / "config.json")
    mode = check_mode(quantization)
    checkpoint_block(config)  # refuses quantization methods other than block FP8, whatever the mode
    device = torch.device(device)
    catalog = _catalog(checkpoint_files(path))
    fp8_names = stored_fp8_projections(catalog, config) if wants_fp8(mode, config, device) else set()
    try:
        model = build_empty_model(config, device, dtype, parallel, fp8=fp8_names)
    except Fp8LayoutError as exc:
        if mode != "auto":
            raise
        logger.warning("%s\nquantization auto: dequantizing the FP8 weights instead", exc)
        model = build_empty_model(config, device, dtype, parallel)
    load_weights(model, path, catalog)
    logger.info("weights stored as %s (%s)", "block FP8" if model.quantization == "fp8" else "the model dtype",
                f"quantization {mode}")
    return model, config
