"""The DSA models (DeepSeek-V3.2, GLM-5): config, loader, tokenizer, and the embedded models `tiny-dsa`
(the default) and `tiny-glm5`.

Public API (see docs/architecture.md):
  `resolve_model_path(name_or_path) -> Path`,
  `load_model(name_or_path, device, dtype, parallel, quantization) -> (model, config)`,
  `build_random_model(config, device, dtype, seed, parallel, quantization)` (benchmarks; no checkpoint),
  `Tokenizer.from_dir(path)`.
  `parallel` (a `decode_server.parallel.state.ParallelState`, None = one device) builds one tensor-parallel rank's
  shard (docs/parallelism.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from decode_server.model.config import ModelConfig, RopeConfig
    from decode_server.model.construct import build_random_model, resolve_dtype
    from decode_server.model.loader import CheckpointError
    from decode_server.model.model import DSAForCausalLM
    from decode_server.model.tokenizer import Tokenizer
    from decode_server.parallel.state import ParallelState

# Names resolved on first use (PEP 562), so that the api process, which only needs the tokenizer, never
# imports torch through this package (seconds of start-up and hundreds of MB).
_LAZY = {
    "ModelConfig": "decode_server.model.config",
    "RopeConfig": "decode_server.model.config",
    "build_random_model": "decode_server.model.construct",
    "resolve_dtype": "decode_server.model.construct",
    "CheckpointError": "decode_server.model.loader",
    "DSAForCausalLM": "decode_server.model.model",
    "Tokenizer": "decode_server.model.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "CheckpointError",
    "DSAForCausalLM",
    "ModelConfig",
    "RopeConfig",
    "Tokenizer",
    "build_random_model",
    "load_config",
    "load_model",
    "resolve_dtype",
    "resolve_model_path",
]


def resolve_model_path(name_or_path: str | Path) -> Path:
    """`tiny-dsa` / `tiny-glm5` → the generated checkpoint (created on first use); otherwise a directory with
    config.json."""
    from decode_server.model.tiny import TINY_SPECS, ensure_tiny_checkpoint

    if str(name_or_path) in TINY_SPECS:
        return ensure_tiny_checkpoint(str(name_or_path))
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither an embedded model ({', '.join(TINY_SPECS)}) nor a checkpoint "
            "directory with config.json"
        )
    return path


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A config by name from configs/ (e.g. "dsv32-bench"), a config JSON file, or a checkpoint's config."""
    from decode_server.model.config import ModelConfig
    from decode_server.model.tiny import CONFIG_DIR, TINY_SPECS

    bundled = CONFIG_DIR / f"{name_or_path}.json"
    if str(name_or_path) not in TINY_SPECS and bundled.is_file():
        return ModelConfig.from_json(bundled)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return ModelConfig.from_json(path)
    return ModelConfig.from_json(resolve_model_path(name_or_path) / "config.json")


def load_model(
    name_or_path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None,
    parallel: ParallelState | None = None, quantization: str | None = "auto",
) -> tuple[DSAForCausalLM, ModelConfig]:
    """Load a checkpoint (or `tiny-dsa` / `tiny-glm5`) onto `device`; dtype None/"auto" = bf16 on CUDA, fp32 on CPU.
    With `parallel`, this tensor-parallel rank's shard, reading only its slice of each tensor. `quantization`
    "auto" | "fp8" | "none": block-FP8 weights stay FP8 ("auto": on CUDA only) or are dequantized
    (decode_server/model/quantization.py)."""
    from decode_server.model.loader import load_checkpoint

    return load_checkpoint(resolve_model_path(name_or_path), device, dtype, parallel, quantization)
