"""Memory sizing on the engine side: device, dtypes, the KV budgets the engine measures or is given, and the pool
sizes they buy.

The sizing rules themselves are pure functions in `decode_server/engine/kv_sizing.py` (budgets in, pool sizes
out), shared with the memory planner (`decode-server plan`); this module only supplies the budgets: explicit ones
from `EngineConfig`, else on CUDA the free device memory after the model is loaded minus the (1 −
`mem_fraction_static`) share (`kv_sizing.kv_budget_from_memory`), on CPU a fixed 256 MiB; the host budget is
explicit or `host_to_device_ratio` × the device budget, capped at half of the host's available memory.
"""

from __future__ import annotations

import gc
import logging

import torch

from decode_server.config import EngineConfig
from decode_server.engine import kv_sizing
from decode_server.engine.kv_rows import FP8_KV_DTYPE, CacheGeometry, row_bytes
from decode_server.hisparse.coordinator import HiSparseLayout

logger = logging.getLogger(__name__)

CPU_DEFAULT_DEVICE_BUDGET = 256 << 20

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    return torch.device(config.device)


def resolve_model_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[config.dtype]


def resolve_kv_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pools' dtype; `fp8_e4m3` resolves to `torch.float8_e4m3fn`, which stands for FlashMLA's 656-byte
    FP8 row (decode_server/engine/kv_rows.py)."""
    if config.kv_cache_dtype == "auto":
        return model_dtype
    if config.kv_cache_dtype == "fp8_e4m3":
        return FP8_KV_DTYPE
    return _DTYPES[config.kv_cache_dtype]


def row_bytes_of(kv_dtype: torch.dtype, geometry: CacheGeometry | None = None) -> int:
    """Bytes of one token's MLA row in one layer (656 for FP8: 43 % fewer than bf16's 1152 for 576 values)."""
    return row_bytes(kv_dtype) if geometry is None else geometry.row_bytes(kv_dtype)


def device_kv_budget(config: EngineConfig, device: torch.device) -> int:
    """Bytes of device memory for KV (+ indexer keys): explicit, else the static fraction minus what is used."""
    if config.device_kv_budget_bytes is not None:
        return config.device_kv_budget_bytes
    if device.type == "cuda":
        # Memory that dead objects still hold (an earlier engine's pools or CUDA graph pools in the same process,
        # reference cycles) is free for this engine: collect it and hand cached blocks back before measuring.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = kv_sizing.kv_budget_from_memory(free, total, config.mem_fraction_static)
        logger.info("device memory when the KV pools are sized: %.0f MiB total, %.0f MiB in use, %.0f MiB of it by "
                    "this process's tensors; KV budget %.0f MiB at mem_fraction_static %.2f", total / 2**20,
                    (total - free) / 2**20, torch.cuda.memory_allocated(device) / 2**20, budget / 2**20,
                    config.mem_fraction_static)
        if budget <= 0:
            raise ValueError(f"no device memory left for KV at mem_fraction_static={config.mem_fraction_static}")
        return budget
    return CPU_DEFAULT_DEVICE_BUDGET


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_kv_budget(config: EngineConfig, device_budget: int, num_pools: int = 1) -> int:
    """Explicit, else `host_to_device_ratio` × the device budget, capped at half of the available host memory
    (pinning more than the machine has would take the whole host down), shared by `num_pools` pools of this
    size on the host (data-parallel attention ranks each hold their own)."""
    if config.host_kv_budget_bytes is not None:
        return config.host_kv_budget_bytes
    ratio = config.hisparse.host_to_device_ratio
    budget = kv_sizing.derived_host_budget(ratio, device_budget, available_host_memory(), num_pools)
    if budget < int(ratio * device_budget):
        logger.warning("host KV budget %.1f GiB capped to %.1f GiB (half of the available host memory%s); set "
                       "host_kv_budget_bytes to choose", ratio * device_budget / 2**30, budget / 2**30,
                       f", shared by {num_pools} pools" if num_pools > 1 else "")  # fmt: skip
    return budget


def plan_dense_slots(
    config: EngineConfig, device: torch.device, num_layers: int, kv_dtype: torch.dtype,
    geometry: CacheGeometry | None = None,
) -> int:
    """Token slots of the dense cache from the config's device budget (`kv_sizing.dense_slots`); `geometry`
    default: DeepSeek-V3.2 sizes, every layer indexed."""
    geometry = geometry if geometry is not None else CacheGeometry(num_layers)
    slots = kv_sizing.dense_slots(device_kv_budget(config, device), geometry, kv_dtype, config.page_size)
    logger.info("dense KV: %d token slots (%d B per token)", slots, geometry.bytes_per_token(kv_dtype))
    return slots


def plan_hisparse(
    config: EngineConfig, device: torch.device, num_layers: int, index_topk: int, kv_dtype: torch.dtype,
    max_ctx: int, geometry: CacheGeometry | None = None,
) -> HiSparseLayout:
    """HiSparse pool sizes from the config's budgets (`kv_sizing.hisparse_layout`)."""
    geometry = geometry if geometry is not None else CacheGeometry(num_layers)
    device_budget = device_kv_budget(config, device)
    host_budget = host_kv_budget(config, device_budget)
    layout = kv_sizing.hisparse_layout(device_budget, host_budget, geometry, kv_dtype, index_topk, max_ctx,
                                       kv_sizing.SizingRules.from_config(config))
    logger.info("hisparse layout: %s", layout)
    return layout
