"""HiSparse coordinator: the lifecycle of a request's KV across the host pool, its device buffer and the GPU
indexer-key cache (admit, grow, preload, retract, resume, free) plus the eager backup's stream and event.

Where a token lives is the rule of docs/architecture.md "HiSparse memory layout". The coordinator keeps it
true between steps; the swap-in kernel keeps it true within a step.

Budgets, checked explicitly at admission and as requests grow:
- host pool: pages for the tokens so far, grown a page at a time as the request decodes;
- device buffers: one buffer of D + R slots per running request;
- indexer keys: pages for the tokens so far, grown in step with the host pages.
When a page is missing the engine retracts a request: its host rows and indexer keys (132 B per token and layer)
are copied out of the pools into private host memory, and its host pages, indexer pages and device buffer are
freed. It resumes later by copying them back into newly allocated pages and preloading a buffer: nothing is
recomputed, so its outputs are the same bits as without the retraction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import kernels
from decode_server.engine.kv_alloc import RequestTokenTable
from decode_server.engine.kv_manager import KVManager
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.engine.types import HiSparseLayerStats, PoolUsage
from decode_server.hisparse.backend import HiSparseBackend
from decode_server.hisparse.counters import HiSparseCounters
from decode_server.hisparse.device_buffer import DeviceBufferPool
from decode_server.hisparse.host_pool import HostKVPool
from decode_server.hisparse.indexer_pool import IndexerKeyPool
from decode_server.hisparse.prefetch import rows_saved_by_bets
from decode_server.hisparse.prefill_staging import PrefillStaging, staging_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HiSparseLayout:
    """Sizes of the three HiSparse pools (all counts, not bytes)."""

    num_layers: int
    top_k: int
    buffer_size: int  # D
    num_recent: int  # R
    num_buffers: int
    host_pages: int
    indexer_pages: int
    page_size: int
    row_bytes: int
    max_reqs: int
    max_ctx: int
    geometry: CacheGeometry | None = None  # MLA / indexer sizes; None: DeepSeek-V3.2's, every layer indexed
    prefill_staging_rows: int = 0  # rows per buffer of the device prefill staging area; 0: none (reference path)

    def __post_init__(self) -> None:
        if self.buffer_size < self.top_k:
            raise ValueError(f"device_buffer_size ({self.buffer_size}) must be >= top_k ({self.top_k})")
        if self.geometry is None:
            object.__setattr__(self, "geometry", CacheGeometry(self.num_layers))
        elif self.geometry.num_layers != self.num_layers:
            raise ValueError(f"geometry has {self.geometry.num_layers} layers, the layout {self.num_layers}")

    @property
    def cache_geometry(self) -> CacheGeometry:
        assert self.geometry is not None  # set in __post_init__
        return self.geometry

    @property
    def buffer_bytes(self) -> int:
        return (self.buffer_size + self.num_recent) * self.row_bytes * self.num_layers

    @property
    def staging_bytes(self) -> int:
        return staging_bytes(self.prefill_staging_rows, self.row_bytes)

    @property
    def indexer_bytes_per_token(self) -> int:
        """Indexer keys of one token over the layers that run the indexer (GLM-5's shared layers have none)."""
        return self.cache_geometry.index_key_bytes * self.cache_geometry.num_index_layers


class HiSparseCoordinator(KVManager):
    """Owns the HiSparse pools and the backup stream; the attention backend reads them during a forward."""

    supports_retraction = True

    def __init__(
        self, layout: HiSparseLayout, kv_dtype: torch.dtype, device: torch.device, reference_kernels: bool = False,
        parallel: Any = None, prefetch_shared_layers: bool = False, early_swap_in: bool = False,
        side_stream_copy_blocks: int | str = 0, speculative_prefetch: bool = False,
    ) -> None:
        """`prefetch_shared_layers`: GLM-5 shared layers' swap-ins start at their full layer, on a side stream
        (`HiSparseConfig.prefetch_shared_layers`); `early_swap_in`: a layer's own swap-in starts when its top-k
        is known (`HiSparseConfig.early_swap_in`); `speculative_prefetch`: each full layer bets its top-k on the
        next full layer's buffer (`HiSparseConfig.speculative_prefetch`); all in decode_server/hisparse/prefetch.py.
        `side_stream_copy_blocks`: the copy kernel's grid cap for those side-stream swap-ins (0: none; "auto": by
        the batch, kernels.dispatch.auto_copy_blocks)."""
        self.layout = layout
        self.kv_dtype = kv_dtype
        self.device = device
        self.reference_kernels = reference_kernels  # PyTorch reference attention / indexer even on CUDA
        geometry = self.cache_geometry = layout.cache_geometry
        self.index_slot = geometry.index_slots()
        self.kv_lora_rank = geometry.kv_lora_rank
        L, ps = layout.num_layers, layout.page_size
        # With tensor parallelism one host pool per node, shared by the ranks (decode_server/hisparse/shared_host.py).
        self.host = HostKVPool(L, layout.host_pages, ps, layout.row_bytes, layout.max_reqs, layout.max_ctx, device,
                               parallel=parallel)
        self.buffers = DeviceBufferPool(
            L, layout.num_buffers, layout.buffer_size, layout.num_recent, layout.row_bytes, layout.max_reqs, device
        )
        self.indexer = IndexerKeyPool(geometry.num_index_layers, layout.indexer_pages, ps, layout.max_reqs,
                                      layout.max_ctx, device, geometry.index_head_dim)
        self.counters = HiSparseCounters(L, layout.row_bytes, device)
        self.backup_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Colocated prefill's device staging area (decode_server/hisparse/prefill_staging.py); its host copies run
        # on the backup stream, so the pending-backup event orders them like the decode backup.
        self.staging = (PrefillStaging(layout.prefill_staging_rows, layout.row_bytes, L, device, self.backup_stream)
                        if layout.prefill_staging_rows > 0 else None)
        self._pending_backup: torch.cuda.Event | None = None
        # The backup that last wrote each request row's rows: freeing or retracting a row waits for that one only,
        # not for a newer step's backup (overlap scheduling frees rows while the next step runs).
        self._row_backup: dict[int, torch.cuda.Event] = {}
        self._saved_index_keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._spilled_rows: dict[int, torch.Tensor] = {}  # retracted requests' host rows, out of the pool
        self.backend = HiSparseBackend(self, prefetch_shared_layers=prefetch_shared_layers,
                                       early_swap_in=early_swap_in, side_stream_copy_blocks=side_stream_copy_blocks,
                                       speculative_prefetch=speculative_prefetch)

    # -- backup ordering --
    def set_pending_backup(self, event: torch.cuda.Event | None, rows: list[int] | None = None) -> None:
        """The newest backup (`rows`: the request rows whose new tokens it copies)."""
        self._pending_backup = event
        if event is not None:
            for row in rows or ():
                self._row_backup[row] = event

    def wait_backup_on_current_stream(self) -> None:
        """Make the current stream (not the CPU) wait for the last backup before touching the pools."""
        if self._pending_backup is not None:
            torch.cuda.current_stream(self.device).wait_event(self._pending_backup)

    def _wait_backup_on_host(self, req_row: int) -> None:
        """Before freeing rows the CPU may hand out again (or copying them out), the last backup of them must be
        done."""
        event = self._row_backup.pop(req_row, None)
        if event is not None and not event.query():  # usually done by now: no host wait then
            event.synchronize()

    # -- budgets --
    def capacity_error(self, prompt_len: int, max_total_len: int) -> str | None:
        lay = self.layout
        if max_total_len > lay.max_ctx:
            return f"{max_total_len} tokens exceed the engine's context length {lay.max_ctx}"
        need_host = self.host.rows.allocator.pages_for(max_total_len)
        if need_host > lay.host_pages:
            return (f"needs {need_host} host KV pages of {lay.page_size} tokens for {max_total_len} tokens; "
                    f"the host pool has {lay.host_pages}")
        need_idx = self.indexer.rows.allocator.pages_for(max_total_len)
        if need_idx > lay.indexer_pages:
            return (f"needs {need_idx} indexer-key pages for {max_total_len} tokens; the GPU indexer cache has "
                    f"{lay.indexer_pages}")
        return None

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    def token_tables(self) -> list[RequestTokenTable]:
        """Host rows and indexer keys: a cached prefix is pages of both (the device buffer is per request)."""
        return [self.host.rows, self.indexer.rows]

    @property
    def max_request_tokens(self) -> int:
        lay = self.layout
        return min(lay.max_ctx, lay.host_pages * lay.page_size, lay.indexer_pages * lay.page_size)

    def free_pages(self) -> int:
        return (min(self.host.rows.allocator.num_free_pages, self.indexer.rows.allocator.num_free_pages)
                + self._evictable_pages())

    def pages_needed(self, req_row: int, num_tokens: int) -> int:
        return max(self.host.rows.pages_needed(req_row, num_tokens),
                   self.indexer.rows.pages_needed(req_row, num_tokens))

    def can_start_request(self) -> bool:
        return self.buffers.free_buffers >= 1

    def _can_grow(self, req_row: int, num_tokens: int) -> bool:
        self._make_room(req_row, num_tokens)
        return (self.host.rows.allocator.can_allocate(self.host.rows.pages_needed(req_row, num_tokens))
                and self.indexer.rows.allocator.can_allocate(self.indexer.rows.pages_needed(req_row, num_tokens)))

    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int,
                  prompt_ids: Sequence[int] | None = None) -> bool:
        """A device buffer, and host and indexer pages for the prompt and the first generated token (after the
        prompt's cached prefix, with prefix caching)."""
        first_tokens = min(prompt_len + 1, max_total_len)
        if not self.can_start_request():
            return False
        self._attach_prefix(req_row, prompt_ids)
        if not self._can_grow(req_row, first_tokens):
            self._release_tables(req_row, None)  # gives the cached prefix back
            return False
        self._admitted(req_row, prompt_ids)
        self.host.rows.ensure(req_row, first_tokens)
        self.indexer.rows.ensure(req_row, first_tokens)
        self.buffers.allocate(req_row)
        return True

    def ensure_room(self, req_row: int, num_tokens: int) -> bool:
        """Host rows and indexer rows for `num_tokens` tokens; False (nothing taken) when either pool is short."""
        if not self._can_grow(req_row, num_tokens):
            return False
        self.host.rows.ensure(req_row, num_tokens)
        self.indexer.rows.ensure(req_row, num_tokens)
        return True

    # -- lifecycle --
    def finish_prefill(self, req_row: int, num_tokens: int) -> None:
        self.preload(req_row, num_tokens)

    def preload(self, req_row: int, num_tokens: int) -> None:
        """Fill a fresh buffer from the host pool before the request decodes token `num_tokens`.

        LRU positions get tokens 0..min(n, D)-1 (identity, so `buffer_tokens` = arange(D) holds both for the
        fast path and, once n > D, as a warm start); the ring gets the tokens the next step treats as recent.
        """
        lay = self.layout
        D, R = lay.buffer_size, lay.num_recent
        self.wait_backup_on_current_stream()
        tokens = list(range(min(num_tokens, D)))
        next_seq_len = num_tokens + 1
        ring_tokens = list(range(max(D, next_seq_len - R), num_tokens))
        slots = [self.buffers.slot_of_new_token(req_row, t) for t in tokens + ring_tokens]
        self.buffers.buffer_tokens[:, req_row] = torch.arange(D, dtype=torch.int32, device=self.device)
        self.buffers.lru_order[:, req_row] = torch.arange(D, dtype=torch.int32, device=self.device)
        if not slots:
            return
        positions = torch.tensor(tokens + ring_tokens, dtype=torch.int64).to(self.device, non_blocking=True)
        src = self.host.rows.slots(req_row, num_tokens)[positions]
        dst = torch.tensor(slots, dtype=torch.int64).to(self.device, non_blocking=True)
        # One launch for all layers on the GPU, reading the pinned host rows through UVA: no host sync.
        kernels.copy_rows(self.host.kv, self.buffers.kv, src, dst)
        for layer in range(lay.num_layers):
            self.counters.add_h2d(layer, len(slots))

    def retract(self, req_row: int, num_tokens: int) -> None:
        """Move the request's host rows (complete after the last backup) and indexer keys out of the pools into
        private host memory, and free its host pages, indexer pages and device buffer."""
        self._wait_backup_on_host(req_row)
        host_slots = self.host.rows.slots(req_row, num_tokens).cpu().long()
        self._spilled_rows[req_row] = self.host.kv[:, host_slots]  # advanced indexing copies
        self._saved_index_keys[req_row] = self.indexer.save(req_row, num_tokens)
        self._release_tables(req_row, None)
        self.buffers.free(req_row)

    def try_resume(self, req_row: int, num_tokens: int) -> bool:
        """A buffer and pages for `num_tokens` + 1 tokens, then the saved rows and keys copied back and the buffer
        preloaded; False (nothing taken) when something is short."""
        if not self.can_start_request() or not self._can_grow(req_row, num_tokens + 1):
            return False
        self.host.rows.ensure(req_row, num_tokens + 1)
        self.indexer.rows.ensure(req_row, num_tokens + 1)
        host_slots = self.host.rows.slots(req_row, num_tokens).cpu().long()
        self.host.kv[:, host_slots] = self._spilled_rows.pop(req_row)
        self.indexer.restore(req_row, self._saved_index_keys.pop(req_row))
        self.buffers.allocate(req_row)
        self.preload(req_row, num_tokens)
        return True

    def free(self, req_row: int, token_ids: Sequence[int] | None = None) -> None:
        self._wait_backup_on_host(req_row)
        self._saved_index_keys.pop(req_row, None)
        spilled = self._spilled_rows.pop(req_row, None) is not None
        self.buffers.free(req_row)
        # A retracted request's rows are out of the pool (its pages were freed then): nothing to keep.
        self._release_tables(req_row, None if spilled else token_ids)

    # -- stats --
    def usage(self) -> dict[str, PoolUsage]:
        return {
            "host_pages": PoolUsage(used=self.host.rows.allocator.num_used_pages, total=self.layout.host_pages),
            "device_slots": PoolUsage(
                used=self.buffers.used_buffers * self.buffers.slots_per_buffer,
                total=self.buffers.num_buffers * self.buffers.slots_per_buffer,
            ),
            "indexer_slots": PoolUsage(
                used=self.indexer.rows.allocator.num_used_pages * self.layout.page_size,
                total=self.layout.indexer_pages * self.layout.page_size,
            ),
        }

    def token_usage(self) -> float:
        """The fullest pool; cached pages that no request maps count as free (as in SGLang)."""
        u = self.usage()
        evictable = self._evictable_pages()
        host = (u["host_pages"].used - evictable) / self.layout.host_pages
        indexer = (self.indexer.rows.allocator.num_used_pages - evictable) / self.layout.indexer_pages
        return max(host, u["device_slots"].fraction, indexer)

    def layer_stats(self) -> list[HiSparseLayerStats]:
        stats = self.counters.snapshot()
        if not self.backend.prefetch.speculative:
            return stats
        saved = rows_saved_by_bets([s.misses for s in stats], self.cache_geometry)
        return [s.model_copy(update={"speculative_rows_saved": saved[s.layer]}) if s.layer in saved else s
                for s in stats]

    def is_empty(self) -> bool:
        cached = self.prefix.cache.num_nodes if self.prefix is not None else 0
        idle_cache = self.prefix is None or self.prefix.is_idle()
        return (self.host.rows.allocator.num_used_pages == cached and self.buffers.used_buffers == 0
                and self.indexer.rows.allocator.num_used_pages == cached and idle_cache
                and not self._saved_index_keys and not self._spilled_rows)
