"""The DeepSeek-V3.2 (DSA) model: config, loader, tokenizer, and the embedded default model `tiny-dsa`.

Public API (see docs/architecture.md):
  `resolve_model_path(name_or_path) -> Path`, `load_model(name_or_path, device, dtype) -> (model, config)`,
  `build_random_model(config, device, dtype, seed)` (benchmarks; no checkpoint), `Tokenizer.from_dir(path)`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from decode_server.model.config import ModelConfig, RopeConfig
from decode_server.model.construct import build_random_model, resolve_dtype
from decode_server.model.loader import CheckpointError, load_checkpoint
from decode_server.model.model import DSAForCausalLM
from decode_server.model.tiny import CONFIG_DIR, TINY_NAME, ensure_tiny_checkpoint
from decode_server.model.tokenizer import Tokenizer

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
    """`tiny-dsa` → its generated checkpoint (created on first use); otherwise a directory with config.json."""
    if str(name_or_path) == TINY_NAME:
        return ensure_tiny_checkpoint()
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {str(name_or_path)!r} is neither {TINY_NAME!r} nor a checkpoint directory with config.json"
        )
    return path


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A config by name from configs/ (e.g. "dsv32-bench"), a config JSON file, or a checkpoint's config."""
    bundled = CONFIG_DIR / f"{name_or_path}.json"
    if str(name_or_path) != TINY_NAME and bundled.is_file():
        return ModelConfig.from_json(bundled)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return ModelConfig.from_json(path)
    return ModelConfig.from_json(resolve_model_path(name_or_path) / "config.json")


def load_model(
    name_or_path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | str | None = None
) -> tuple[DSAForCausalLM, ModelConfig]:
    """Load a checkpoint (or `tiny-dsa`) onto `device`; dtype None/"auto" = bf16 on CUDA, fp32 on CPU."""
    return load_checkpoint(resolve_model_path(name_or_path), device, dtype)
