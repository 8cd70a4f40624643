"""Memory sizing: from `EngineConfig` (explicit byte budgets, or `mem_fraction_static` on CUDA) to pool sizes.

Dense: the device budget buys tokens of (MLA row for every layer + indexer key for every layer that runs the
indexer: all of DeepSeek-V3.2's, GLM-5's "full" layers only).
HiSparse: the host budget (explicit, or `host_to_device_ratio` × the device budget) buys host KV pages; the
device budget first holds the indexer keys of as many tokens as the host pool holds (the indexer must see every
token of every running request), and the rest buys request buffers of D + R slots, at most one per request row.
If that leaves no buffer, the indexer share shrinks to what is left after one buffer per request row.
"""

from __future__ import annotations

import gc
import logging

import torch

from decode_server.config import EngineConfig
from decode_server.engine.kv_rows import FP8_KV_DTYPE, CacheGeometry, row_bytes
from decode_server.hisparse.coordinator import HiSparseLayout
from decode_server.hisparse.prefill_staging import STAGING_ROW_ALIGN, staging_bytes

logger = logging.getLogger(__name__)

CPU_DEFAULT_DEVICE_BUDGET = 256 << 20
# A derived (not explicit) host budget never takes more than this share of the memory available now.
HOST_AVAILABLE_FRACTION = 0.5

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
        budget = int(free - (1.0 - config.mem_fraction_static) * total)
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
    budget = int(config.hisparse.host_to_device_ratio * device_budget)
    available = available_host_memory()
    if available is not None and budget * num_pools > HOST_AVAILABLE_FRACTION * available:
        capped = int(HOST_AVAILABLE_FRACTION * available) // num_pools
        logger.warning("host KV budget %.1f GiB capped to %.1f GiB (half of the available host memory%s); set "
                       "host_kv_budget_bytes to choose", budget / 2**30, capped / 2**30,
                       f", shared by {num_pools} pools" if num_pools > 1 else "")  # fmt: skip
        budget = capped
    return budget


def plan_dense_slots(
    config: EngineConfig, device: torch.device, num_layers: int, kv_dtype: torch.dtype,
    geometry: CacheGeometry | None = None,
) -> int:
    """Token slots of the dense cache: MLA rows of every layer + indexer keys of the layers that run the
    indexer (`geometry`; default DeepSeek-V3.2 sizes, every layer indexed)."""
    geometry = geometry if geometry is not None else CacheGeometry(num_layers)
    per_token = geometry.bytes_per_token(kv_dtype)
    slots = device_kv_budget(config, device) // per_token
    slots -= slots % config.page_size
    if slots < config.page_size:
        raise ValueError(f"the device KV budget holds {slots} tokens, less than one page of {config.page_size}")
    logger.info("dense KV: %d token slots (%d B per token)", slots, per_token)
    return slots


# Share of the device KV budget the default prefill staging area may take.
STAGING_BUDGET_FRACTION = 1 / 8


def prefill_staging_rows(config: EngineConfig, device_budget: int, row_bytes: int, max_request_tokens: int) -> int:
    """Rows per buffer of HiSparse's prefill staging area (decode_server/hisparse/prefill_staging.py).

    Explicit `hisparse.prefill_staging_tokens` wins. Default: what the scheduler's largest prefill batch needs (one
    request's prefix up to the longest request, plus a chunk of new tokens), rounded up to the row alignment, but
    at most `STAGING_BUDGET_FRACTION` of the device budget (a batch that does not fit takes the slower gather path).
    """
    if config.hisparse.prefill_staging_tokens is not None:
        return config.hisparse.prefill_staging_tokens
    align = STAGING_ROW_ALIGN
    need = -(-(max_request_tokens + config.chunked_prefill_size) // align) * align
    cap = int(device_budget * STAGING_BUDGET_FRACTION) // staging_bytes(align, row_bytes) * align
    return min(need, cap)


def plan_hisparse(
    config: EngineConfig, device: torch.device, num_layers: int, index_topk: int, kv_dtype: torch.dtype,
    max_ctx: int, geometry: CacheGeometry | None = None,
) -> HiSparseLayout:
    """HiSparse pool sizes; indexer keys are counted only for the layers that run the indexer (`geometry`)."""
    geometry = geometry if geometry is not None else CacheGeometry(num_layers)
    hs = config.hisparse
    top_k = hs.top_k or index_topk
    buffer_size = hs.device_buffer_size or 2 * top_k
    if buffer_size < top_k:
        raise ValueError(f"hisparse device_buffer_size ({buffer_size}) must be >= top_k ({top_k})")
    rb = row_bytes_of(kv_dtype, geometry)
    ps = config.page_size
    device_budget = device_kv_budget(config, device)
    host_budget = host_kv_budget(config, device_budget)
    host_pages = host_budget // (rb * num_layers * ps)
    if host_pages < 1:
        raise ValueError(f"the host KV budget ({host_budget} B) holds less than one page of {ps} tokens")
    staging_rows = prefill_staging_rows(config, device_budget, rb, min(max_ctx, host_pages * ps))
    device_budget -= staging_bytes(staging_rows, rb)
    buffer_bytes = (buffer_size + hs.num_recent_slots) * rb * num_layers
    idx_page_bytes = geometry.index_key_bytes * geometry.num_index_layers * ps
    indexer_pages = min(host_pages, device_budget // idx_page_bytes)
    num_buffers = min(config.max_running_requests, (device_budget - indexer_pages * idx_page_bytes) // buffer_bytes)
    if num_buffers < 1:
        num_buffers = min(config.max_running_requests, device_budget // (buffer_bytes + idx_page_bytes))
        indexer_pages = (device_budget - num_buffers * buffer_bytes) // idx_page_bytes
    if num_buffers < 1 or indexer_pages < 1:
        raise ValueError(
            f"the device KV budget ({device_budget} B) cannot hold one request buffer ({buffer_bytes} B) and one "
            f"page of indexer keys ({idx_page_bytes} B)"
        )
    layout = HiSparseLayout(
        num_layers=num_layers, top_k=top_k, buffer_size=buffer_size, num_recent=hs.num_recent_slots,
        num_buffers=num_buffers, host_pages=host_pages, indexer_pages=indexer_pages, page_size=ps, row_bytes=rb,
        max_reqs=config.max_running_requests, max_ctx=max_ctx, geometry=geometry, prefill_staging_rows=staging_rows,
    )
    logger.info("hisparse layout: %s", layout)
    return layout
