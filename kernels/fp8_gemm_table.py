"""Tuned FP8 GEMM choices per GPU model, shipped as JSON files (kernels/fp8_gemm_tables/<device>.json).

Why a table and not a per-process measurement: a choice decided by timing at start-up can differ between two
processes on the same machine (another process was busy on the GPU, two candidates were within noise), and two
kernels round differently, so two replicas of one model — or a server with and without CUDA graphs — would give
different tokens for the same request. A table measured once per GPU model (`benchmarks/tune_fp8_gemm.py` on the
device) makes the choice a pure function of (GPU model, shape, M bucket): every process decides the same. Shapes the
table lacks take the untimed default Triton configuration, which is deterministic too.

File format: {"device": "<torch.cuda.get_device_name>", "torch": ..., "triton": ..., "measured": ..., "entries":
[{"kind": "dense"|"grouped"|"batched", "n": N, "k": K, "experts": E, "bucket": M, "dtype": "bfloat16", "backend": "triton"|
"scaled_mm", "config": {TritonGemmConfig fields} | null, "us": {label: µs, ...}}]}.
`$HISPARSE_FP8_GEMM_TABLE=PATH` reads another file instead (any device).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

TABLE_DIR = Path(__file__).resolve().parent / "fp8_gemm_tables"
TABLE_ENV = "HISPARSE_FP8_GEMM_TABLE"

# (kind, n, k, experts, bucket, dtype name) → (backend, config fields or None)
TableKey = tuple[str, int, int, int, int, str]
TableChoice = tuple[str, dict[str, int] | None]


def device_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' → 'nvidia_h100_80gb_hbm3' (the table's file name)."""
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def table_path(device_name: str) -> Path:
    override = os.environ.get(TABLE_ENV)
    return Path(override) if override else TABLE_DIR / f"{device_slug(device_name)}.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def entry_key(entry: dict[str, Any]) -> TableKey:
    return (str(entry["kind"]), int(entry["n"]), int(entry["k"]), int(entry["experts"]), int(entry["bucket"]),
            str(entry["dtype"]))


def read_table(path: Path) -> dict[TableKey, TableChoice]:
    """The entries of one table file ({} when it does not exist). A malformed file raises ValueError: a table
    that silently reads as empty would change every choice back to the defaults unnoticed."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {entry_key(e): (str(e["backend"]), e.get("config")) for e in data["entries"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"FP8 GEMM table {path} is malformed: {exc}") from exc


@functools.cache
def _device_table(device_name: str, path_text: str) -> dict[TableKey, TableChoice]:
    table = read_table(Path(path_text))
    if table:
        logger.info("FP8 GEMM table %s: %d tuned shapes for %s", path_text, len(table), device_name)
    else:
        logger.info("no FP8 GEMM table for %s (%s): every shape takes the default Triton configuration",
                    device_name, path_text)
    return table


def device_table(device_name: str) -> dict[TableKey, TableChoice]:
    """The table of one GPU model, read once per process."""
    return _device_table(device_name, str(table_path(device_name)))


def write_table(path: Path, device_name: str, entries: list[dict[str, Any]], meta: dict[str, Any]) -> int:
    """Merge `entries` (same format as the file's) into the table at `path` (new keys added, measured keys
    replaced); returns the number of entries written."""
    existing: dict[TableKey, dict[str, Any]] = {}
    if path.exists():
        previous = json.loads(path.read_text())
        existing = {entry_key(e): e for e in previous["entries"]}
        earlier = str(previous.get("command", ""))
        if earlier and "command" in meta and meta["command"] not in earlier.split(" && "):
            meta = {**meta, "command": f"{earlier} && {meta['command']}"}  # merged runs: every command
    for entry in entries:
        existing[entry_key(entry)] = entry
    ordered = [existing[key] for key in sorted(existing)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": device_name, **meta, "entries": ordered}, indent=1) + "\n")
    return len(ordered)


def config_fields(config: object | None) -> dict[str, int] | None:
    return dataclasses.asdict(config) if config is not None else None  # type: ignore[call-overload]
