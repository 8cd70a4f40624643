"""The KV sizing rules as pure functions of numbers: budgets in, pool sizes (and how many requests fit) out.

The engine calls them with the budgets it measured or was given (`decode_server/engine/memory.py`), the memory
planner (`decode-server plan`, `decode_server/planner.py`) with budgets it computed from a config.json, so the two
cannot drift apart: there is one implementation of every rule below.

Dense: the device budget buys tokens of (MLA row for every layer + indexer key for every layer that runs the
indexer: all of DeepSeek-V3.2's, GLM-5's "full" layers only), in whole pages.
HiSparse: the host budget buys host KV pages; the prefill staging area (two buffers of rows) comes off the device
budget first; the rest first holds the indexer keys of as many tokens as the host pool holds (the indexer must see
every token of every running request), and what is left buys request buffers of D + R slots, at most one per
request row. If that leaves no buffer, buffers come first and the indexer gets the rest.

Every pool has `SCRATCH_SLOTS` rows past what its allocator hands out (padded rows of CUDA-graph decode batches
write there) and per-request tables on the device; those bytes are not taken from the budget (`*_bytes` below
say what is allocated).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from decode_server.config import EngineConfig, HiSparseConfig
from decode_server.engine.forward_batch import SCRATCH_SLOTS
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.hisparse.coordinator import HiSparseLayout
from decode_server.hisparse.prefill_staging import STAGING_ROW_ALIGN, staging_bytes

# Share of the device KV budget the default prefill staging area may take.
STAGING_BUDGET_FRACTION = 1 / 8
# A derived (not explicit) host budget never takes more than this share of the host memory available.
HOST_AVAILABLE_FRACTION = 0.5
# Bytes of one entry of the per-request device tables (token -> slot, LRU state): int32.
TABLE_ENTRY_BYTES = 4


@dataclass(frozen=True)
class SizingRules:
    """The scheduling settings that pool sizes depend on (EngineConfig fields)."""

    page_size: int
    max_running_requests: int
    chunked_prefill_size: int
    hisparse: HiSparseConfig

    @classmethod
    def from_config(cls, config: EngineConfig) -> SizingRules:
        return cls(page_size=config.page_size, max_running_requests=config.max_running_requests,
                   chunked_prefill_size=config.chunked_prefill_size, hisparse=config.hisparse)


# -- budgets -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVBudgets:
    """Bytes of device memory for KV pools (+ indexer keys, prefill staging) per GPU, and of the HiSparse host
    pool (0 in dense mode; with tensor parallelism one pool per node, shared by the ranks)."""

    device: int
    host: int


def kv_budget_from_memory(free_bytes: int, total_bytes: int, mem_fraction_static: float) -> int:
    """The device KV budget under `--mem-fraction-static` (SGLang's rule): what is free when the pools are sized,
    minus the (1 − f) share of the device that stays for activations, CUDA graphs, NCCL buffers and the
    per-request tables. Equal to f × total − memory in use (weights, CUDA context, ...)."""
    return int(free_bytes - (1.0 - mem_fraction_static) * total_bytes)


def derived_host_budget(host_to_device_ratio: float, device_budget: int, available_host: int | None,
                        num_pools: int = 1) -> int:
    """`host_to_device_ratio` × the device budget, capped at `HOST_AVAILABLE_FRACTION` of the host memory
    available (None: no cap) shared by `num_pools` pools of this size on the host (data-parallel attention ranks
    each hold their own); pinning more than the machine has would take the whole host down."""
    budget = int(host_to_device_ratio * device_budget)
    if available_host is not None:
        budget = min(budget, int(HOST_AVAILABLE_FRACTION * available_host) // num_pools)
    return budget


def resolve_context_length(requested: int | None, model_max: int) -> int:
    """The engine's context length: `--context-length`, capped by the model's `max_position_embeddings`."""
    context = min(requested or model_max, model_max or requested or 0)
    if context <= 0:
        raise ValueError("context length unknown: set context_length")
    return context


# -- dense ------------------------------------------------------------------------------------------------------

def dense_slots(device_budget: int, geometry: CacheGeometry, kv_dtype: torch.dtype, page_size: int) -> int:
    """Token slots of the dense cache: whole pages of (MLA rows of every layer + indexer keys of the layers that
    run the indexer)."""
    per_token = geometry.bytes_per_token(kv_dtype)
    slots = max(device_budget, 0) // per_token
    slots -= slots % page_size
    if slots < page_size:
        raise ValueError(f"the device KV budget ({device_budget} B) holds {slots} tokens of {per_token} B, less "
                         f"than one page of {page_size}")
    return slots


def dense_pool_bytes(slots: int, geometry: CacheGeometry, kv_dtype: torch.dtype) -> int:
    """Device bytes the dense cache allocates: its slots plus the scratch slots, MLA rows and indexer keys."""
    return (slots + SCRATCH_SLOTS) * geometry.bytes_per_token(kv_dtype)


def dense_table_bytes(max_running_requests: int, max_ctx: int) -> int:
    """The dense token → slot table on the device ([requests + scratch row, context] int32), outside the budget."""
    return (max_running_requests + 1) * max_ctx * TABLE_ENTRY_BYTES


# -- HiSparse ---------------------------------------------------------------------------------------------------

def prefill_staging_rows(hisparse: HiSparseConfig, device_budget: int, row_bytes: int, max_request_tokens: int,
                         chunked_prefill_size: int) -> int:
    """Rows per buffer of HiSparse's prefill staging area (decode_server/hisparse/prefill_staging.py).

    Explicit `hisparse.prefill_staging_tokens` wins. Default: what the scheduler's largest prefill batch needs (one
    request's prefix up to the longest request, plus a chunk of new tokens), rounded up to the row alignment, but
    at most `STAGING_BUDGET_FRACTION` of the device budget (a batch that does not fit takes the slower gather path).
    """
    if hisparse.prefill_staging_tokens is not None:
        return hisparse.prefill_staging_tokens
    align = STAGING_ROW_ALIGN
    need = -(-(max_request_tokens + chunked_prefill_size) // align) * align
    cap = int(device_budget * STAGING_BUDGET_FRACTION) // staging_bytes(align, row_bytes) * align
    return min(need, cap)


def hisparse_layout(
    device_budget: int, host_budget: int, geometry: CacheGeometry, kv_dtype: torch.dtype, index_topk: int,
    max_ctx: int, rules: SizingRules,
) -> HiSparseLayout:
    """HiSparse pool sizes from the two budgets; indexer keys are counted only for the layers that run the
    indexer (`geometry`). ValueError when the budgets cannot hold one request."""
    hs = rules.hisparse
    top_k = hs.top_k or index_topk
    buffer_size = hs.device_buffer_size or 2 * top_k
    if buffer_size < top_k:
        raise ValueError(f"hisparse device_buffer_size ({buffer_size}) must be >= top_k ({top_k})")
    num_layers = geometry.num_layers
    rb = geometry.row_bytes(kv_dtype)
    ps = rules.page_size
    host_pages = max(host_budget, 0) // (rb * num_layers * ps)
    if host_pages < 1:
        raise ValueError(f"the host KV budget ({host_budget} B) holds less than one page of {ps} tokens")
    staging_rows = prefill_staging_rows(hs, device_budget, rb, min(max_ctx, host_pages * ps),
                                        rules.chunked_prefill_size)
    device_budget -= staging_bytes(staging_rows, rb)
    buffer_bytes = (buffer_size + hs.num_recent_slots) * rb * num_layers
    idx_page_bytes = geometry.index_key_bytes * geometry.num_index_layers * ps
    max_reqs = rules.max_running_requests
    indexer_pages = min(host_pages, max(device_budget, 0) // idx_page_bytes)
    num_buffers = min(max_reqs, (device_budget - indexer_pages * idx_page_bytes) // buffer_bytes)
    if num_buffers < 1:
        num_buffers = min(max_reqs, device_budget // (buffer_bytes + idx_page_bytes))
        indexer_pages = (device_budget - num_buffers * buffer_bytes) // idx_page_bytes
    if num_buffers < 1 or indexer_pages < 1:
        raise ValueError(
            f"the device KV budget ({device_budget} B after the prefill staging area) cannot hold one request "
            f"buffer ({buffer_bytes} B) and one page of indexer keys ({idx_page_bytes} B)"
        )
    return HiSparseLayout(
        num_layers=num_layers, top_k=top_k, buffer_size=buffer_size, num_recent=hs.num_recent_slots,
        num_buffers=num_buffers, host_pages=host_pages, indexer_pages=indexer_pages, page_size=ps, row_bytes=rb,
        max_reqs=max_reqs, max_ctx=max_ctx, geometry=geometry, prefill_staging_rows=staging_rows,
    )


@dataclass(frozen=True)
class HiSparseBytes:
    """What a HiSparse layout allocates, in bytes (device pools include their scratch slots)."""

    device_buffers: int
    device_indexer: int
    device_staging: int
    device_tables: int  # outside the budget: host-row and indexer-row tables, buffer slots, LRU state
    host_pool: int

    @property
    def device_pools(self) -> int:
        return self.device_buffers + self.device_indexer + self.device_staging


def hisparse_bytes(layout: HiSparseLayout) -> HiSparseBytes:
    geometry = layout.cache_geometry
    L, rows = layout.num_layers, layout.max_reqs + 1
    buffer_slots = layout.num_buffers * (layout.buffer_size + layout.num_recent) + SCRATCH_SLOTS
    indexer_rows = layout.indexer_pages * layout.page_size + SCRATCH_SLOTS
    tables = (2 * rows * layout.max_ctx  # host-row and indexer-row tables
              + rows * (layout.buffer_size + layout.num_recent)  # buffer slots
              + 2 * L * rows * layout.buffer_size  # LRU tokens and order
              + layout.buffer_size) * TABLE_ENTRY_BYTES  # identity
    return HiSparseBytes(
        device_buffers=L * buffer_slots * layout.row_bytes,
        device_indexer=geometry.num_index_layers * indexer_rows * geometry.index_key_bytes,
        device_staging=layout.staging_bytes,
        device_tables=tables,
        host_pool=L * layout.host_pages * layout.page_size * layout.row_bytes,
    )


# -- capacity ---------------------------------------------------------------------------------------------------

def request_kv_tokens(context_length: int) -> int:
    """Tokens of KV a request of `context_length` tokens (prompt + output) holds at its end: the last sampled token
    is never fed back (`Request.max_total_len`)."""
    return max(context_length - 1, 1)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(frozen=True)
class Capacity:
    """How many requests of one size fit at once, and what binds."""

    max_requests: int
    limit: str  # the binding resource


def _smallest(limits: dict[str, int]) -> Capacity:
    """The smallest limit; on a tie the first named (the cause: a cap before what it caps)."""
    name = min(limits, key=lambda k: limits[k])
    return Capacity(max(limits[name], 0), name)


def dense_capacity(slots: int, page_size: int, max_running_requests: int, kv_tokens: int) -> Capacity:
    """Requests holding `kv_tokens` tokens each that the dense cache holds at once (the scheduler admits a request
    when the pages for its tokens are free and a request row is)."""
    return _smallest({"max_running_requests": max_running_requests,
                      "device KV cache": (slots // page_size) // pages_for(kv_tokens, page_size)})


def hisparse_capacity(layout: HiSparseLayout, kv_tokens: int) -> Capacity:
    """Requests holding `kv_tokens` tokens each that a HiSparse layout holds at once: each needs a device buffer,
    and host and indexer pages for its tokens."""
    pages = pages_for(kv_tokens, layout.page_size)
    # Buffers are capped by the request rows, indexer pages by the host pages: the caps come first.
    return _smallest({"max_running_requests": layout.max_reqs,
                      "device buffers": layout.num_buffers,
                      "host KV pool": layout.host_pages // pages,
                      "GPU indexer keys": layout.indexer_pages // pages})


def best_hisparse_batch(device_budget: int, geometry: CacheGeometry, kv_dtype: torch.dtype, index_topk: int,
                        rules: SizingRules, max_ctx: int, kv_tokens: int, host_per_request: int) -> tuple[int, int]:
    """The most requests of `kv_tokens` tokens the device budget holds when the host pool is sized for exactly
    them (`hisparse_layout` with host budget n × one request's host rows), and that host budget: a binary search
    over n ≤ `rules.max_running_requests` with the same sizing function. The planner reports it; the decode
    benchmark sizes its pinned pool with it (a pool larger than the batch the device holds is pinned for nothing)."""

    def holds(n: int) -> bool:
        try:
            layout = hisparse_layout(device_budget, n * host_per_request, geometry, kv_dtype, index_topk, max_ctx,
                                     rules)
        except ValueError:
            return False
        return hisparse_capacity(layout, kv_tokens).max_requests >= n

    low, high = 0, rules.max_running_requests
    while low < high:
        mid = (low + high + 1) // 2
        if holds(mid):
            low = mid
        else:
            high = mid - 1
    return low, low * host_per_request
