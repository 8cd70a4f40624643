"""Block-FP8 weights kept in FP8 (`--quantization auto|fp8|none`): which tensors, when it applies, how they are cut.

DeepSeek-V3.2 and GLM-5 ship their projections as float8 e4m3 with one float32 `weight_scale_inv` per 128×128
block (`quantization_config`: `quant_method` "fp8", `weight_block_size` [128, 128]). With FP8 storage those
projections stay FP8 in device memory — the checkpoint's bytes, cut by the tensor-parallel loader — and run as
block-FP8 GEMMs (kernels/fp8_gemm.py): MLA q_a / q_b / kv_a / o, the indexer's wq_b and wk, dense MLPs, shared
experts and routed experts. Stored otherwise, whatever the checkpoint says:
  - `kv_b_proj` stays FP8 as loaded, but the absorbed MLA path multiplies per head by W_UK / W_UV: in FP8 from
    kv_b_proj's own blocks where every head is whole 128-blocks (DeepSeek-V3.2; batched FP8 GEMMs, as SGLang's
    DeepGEMM-bmm option), else dequantized to the model dtype once after loading, as SGLang's default does
    (GLM-5; attention.py `absorb_weights`);
  - the indexer's `weights_proj` (kept float32, read directly), embeddings, the LM head and the router are not
    FP8 in the checkpoints and stay as the model dtype (router and weights_proj float32).

Modes (`check_mode`, `wants_fp8`; the engine's `resolve_quantization` maps `--quantization` onto them):
  - "none": every FP8 tensor is dequantized at load into the model dtype (the behaviour before FP8 storage);
  - "fp8": the checkpoint must be block-FP8 (128×128); every projection it stores in FP8 stays FP8; a tensor-parallel
    piece that does not start and end on a 128-block edge is refused (`Fp8LayoutError`, naming the tensors);
  - "auto" (the default): "fp8" on CUDA for a block-FP8 checkpoint whose pieces align, else "none" — on CPU always
    "none" (the server and `make test` on CPU dequantize as before; `load_model(..., quantization="fp8")` on CPU
    keeps FP8 and runs the PyTorch reference GEMMs, for tests). Misaligned pieces under "auto" are logged and
    dequantized.

This module is the one place the engine (through the loader and `build_empty_model`) and the memory planner
(`decode-server plan`, decode_server/planner.py) take these rules from: the planner builds the same module tree on
the meta device with the same `fp8=` argument and counts its tensors (decode_server/model/weights.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterable

import torch
from torch import nn

from decode_server.model.batch_invariant import Linear
from decode_server.model.config import ModelConfig

logger = logging.getLogger(__name__)

QUANTIZATION_MODES = ("auto", "fp8", "none")
FP8_BLOCK = (128, 128)
FP8_DTYPE = torch.float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
# Projections whose weights DeepSeek-V3.2 / GLM-5 checkpoints store as block FP8 (module names, last component).
FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "gate_proj",
                   "up_proj", "down_proj")


class Fp8LayoutError(ValueError):
    """Block-FP8 storage cannot hold this model's tensor-parallel pieces (they cut through 128-blocks)."""


def checkpoint_block(config: ModelConfig) -> tuple[int, int] | None:
    """The checkpoint's FP8 weight block when `quantization_config` says block FP8, else None. Other quantization
    methods are refused (ValueError): the loader reads block-FP8 and unquantized checkpoints only."""
    q = config.quantization_config or {}
    method = str(q.get("quant_method", "")).lower()
    if method and method != "fp8":
        raise ValueError(f"quantization_config quant_method {method!r} is not supported: this server reads block-FP8 "
                         "checkpoints (quant_method fp8, DeepSeek's format) and unquantized ones")
    if method != "fp8" or not q.get("weight_block_size"):
        return None
    return config.weight_block_size


def is_fp8_projection(name: str) -> bool:
    """Whether a state-dict name is a projection weight that block-FP8 storage keeps in FP8."""
    if not name.endswith(".weight"):
        return False
    module = name[: -len(".weight")].rsplit(".", 1)[-1]
    return module in FP8_PROJECTIONS


def check_mode(quantization: str | None) -> str:
    mode = quantization or "auto"
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"quantization {quantization!r}: expected one of {QUANTIZATION_MODES}")
    return mode


def resolve_quantization(requested: str | None, device: torch.device) -> str:
    """`--quantization` → the loader's mode, as the engine (and the planner, planning it) applies it: the
    checkpoint decides ("auto") unless set; on CPU the engine always dequantizes (the FP8 GEMMs are GPU kernels; the
    CPU reference would only be slow), saying so when FP8 was asked for."""
    mode = check_mode(requested)
    if device.type != "cuda":
        if mode == "fp8":
            logger.warning("--quantization fp8 on %s: the weights are dequantized (FP8 GEMMs run on CUDA only)",
                           device.type)
        return "none"
    return mode


def wants_fp8(quantization: str | None, config: ModelConfig, device: torch.device) -> bool:
    """Whether to try FP8 storage for a checkpoint (before its tensors and pieces are known)."""
    mode = check_mode(quantization)
    if mode == "none":
        return False
    block = checkpoint_block(config)
    if mode == "fp8":
        if block is None:
            raise ValueError("--quantization fp8 needs a block-FP8 checkpoint (quantization_config with quant_method "
                             "'fp8' and weight_block_size); this one has none: use --quantization none")
        if block != FP8_BLOCK:
            raise ValueError(f"--quantization fp8 supports 128x128 weight blocks, the checkpoint has {block}")
        return True
    return device.type == "cuda" and block == FP8_BLOCK


def fp8_linears(model: nn.Module, names: Collection[str] | None = None) -> dict[str, Linear]:
    """Weight name → Linear of every projection FP8 storage may hold (`names`: restricted to those)."""
    out = {}
    for prefix, module in model.named_modules():
        weight = f"{prefix}.weight"
        if isinstance(module, Linear) and is_fp8_projection(weight) and (names is None or weight in names):
            out[weight] = module
    return out


def layout_problems(linears: dict[str, Linear], block: tuple[int, int]) -> list[str]:
    """Tensor-parallel pieces that do not start and end on block edges (one line per tensor)."""
    problems = []
    for name, linear in linears.items():
        shard = getattr(linear, "shards", {}).get("weight")
        if shard is None:
            continue
        local = int(linear.weight.shape[shard.dim])
        if local % block[shard.dim]:
            side = "rows (output features)" if shard.dim == 0 else "columns (input features)"
            problems.append(f"{name}: {local} {side} per rank, not a multiple of {block[shard.dim]}")
    return problems


def use_fp8_storage(model: nn.Module, names: Collection[str] | None = None,
                    block: tuple[int, int] = FP8_BLOCK) -> int:
    """Turn the projections (`names`, default all of FP8_PROJECTIONS) of a model still on the meta device into
    FP8 weights + block scales. Raises Fp8LayoutError if a tensor-parallel piece cuts through a block. Returns how
    many layers were converted."""
    linears = fp8_linears(model, names)
    problems = layout_problems(linears, block)
    if problems:
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise Fp8LayoutError(
            f"FP8 weights are stored in {block[0]}x{block[1]} blocks with one scale each, so every tensor-parallel "
            f"piece must start and end on a block edge; {len(problems)} do not:\n  " + "\n  ".join(problems[:8])
            + more + "\nUse --quantization none (dequantize to the model dtype at load) or a --tp-size / --ep-size "
            "whose pieces are multiples of the block."
        )
    for linear in linears.values():
        linear.use_fp8_storage(block)
    return len(linears)


def is_fp8_state(name: str, tensor: torch.Tensor) -> bool:
    """FP8 weights and their scales keep their own dtypes when the model is cast to the model dtype."""
    return tensor.dtype == FP8_DTYPE or name.endswith(SCALE_SUFFIX)


def model_quantization(model: nn.Module) -> str:
    """"fp8" when some weight is stored in FP8, else "none"."""
    return "fp8" if any(p.dtype == FP8_DTYPE for p in model.parameters()) else "none"


def random_fp8_(weight: torch.Tensor, scale: torch.Tensor, std: float, generator: torch.Generator,
                full_weight_shape: Iterable[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random FP8 values and block scales whose dequantized weight has standard deviation ≈ std, drawn on the
    tensors' device: values N(0, 64²) (clamped to ±448, so most of e4m3's range is used) and scales
    std/64 · U[0.5, 1.5) per block (blocks differ, as in real checkpoints). With `full_weight_shape` (tensor
    parallelism) the full tensors are drawn and returned for the caller to slice; else `weight` and `scale` are
    filled in place and returned."""
    shape = tuple(full_weight_shape) if full_weight_shape is not None else tuple(weight.shape)
    values = torch.randn(shape, generator=generator, device=weight.device, dtype=torch.float32)
    values = values.mul_(64.0).clamp_(-448.0, 448.0).to(FP8_DTYPE)
    block_rows, block_cols = (math.ceil(d / b) for d, b in zip(shape, FP8_BLOCK, strict=True))
    scales = torch.rand((block_rows, block_cols), generator=generator, device=weight.device, dtype=torch.float32)
    scales = scales.add_(0.5).mul_(std / 64.0)
    if full_weight_shape is not None:
        return values, scales
    weight.copy_(values)
    scale.copy_(scales)
    return weight, scale
