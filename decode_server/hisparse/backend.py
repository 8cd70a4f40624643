"""HiSparse attention backend: the model's KV calls mapped onto the host pool, the per-request device buffers
and the GPU indexer-key cache owned by the `HiSparseCoordinator`.

Decode (every request extends by one token):
  write_kv           → the new row goes to the request's slot for the new token (identity while seq_len <= D,
                       else its recent-ring slot), so the token generated one step ago is always on the device;
  write_index_keys   → GPU indexer cache (every token of every running request stays there);
  index_topk         → the indexer over all tokens of each request (same keys, same order as dense);
  prepare_attention  → with `early_swap_in` (off by default) the layer's swap-in starts here, on a side stream,
                       so the model's query and KV-row projections run beside it;
  sparse_attention   → swap-in maps top-k positions to device slots, loading misses from the host pool, then
                       sparse MLA over the device pool; identical rows in identical order as dense. With
                       `prefetch_shared_layers`, a full layer also starts its GLM-5 shared followers' swap-ins
                       (same top-k) on a side stream, and each follower takes those slots
                       (decode_server/hisparse/prefetch.py);
  end_forward        → eager backup of the new rows (all layers) to the host pool on a side stream.
Prefill (colocated; any extend length), on the device (decode_server/hisparse/prefill_staging.py): per layer,
the requests' prefix rows are staged host pool → a two-layer device staging area on a side stream (overlapping
the previous layer's compute), the chunk's new rows are written there too, the attention runs over the staging
area with positions mapped to its rows on the device, and the new rows then go to the host pool, their home. No
host sync beyond dense prefill's. A batch larger than the staging area (or no staging area) takes the reference
path: new rows written to the host pool synchronously, each chunk's selected rows gathered from it on the CPU.
After the last chunk the coordinator preloads the buffer.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.forward_batch import ForwardBatch
from decode_server.engine.kv_rows import CacheGeometry, attention_rows, encode_row_bytes
from decode_server.hisparse import ops
from decode_server.hisparse.counters import HiSparseCounters
from decode_server.hisparse.device_buffer import DeviceBufferPool
from decode_server.hisparse.host_pool import HostKVPool
from decode_server.hisparse.indexer_pool import IndexerKeyPool
from decode_server.hisparse.prefetch import SwapInPrefetch, next_full_layers, shared_followers
from decode_server.hisparse.prefill_staging import PrefillStaging
from kernels import BoundSwapIn, SwapInTables

logger = logging.getLogger(__name__)


class HiSparseMemory(Protocol):
    """What the backend reads and orders of the HiSparse memory's owner (`HiSparseCoordinator`, which builds its
    backend): the pools, the counters, the backup stream and the ordering of backups."""

    kv_dtype: torch.dtype
    device: torch.device
    reference_kernels: bool  # PyTorch reference attention / indexer even on CUDA
    index_slot: dict[int, int]  # layer id → its layer in the indexer-key cache
    kv_lora_rank: int
    host: HostKVPool
    buffers: DeviceBufferPool
    indexer: IndexerKeyPool
    counters: HiSparseCounters
    staging: PrefillStaging | None
    backup_stream: torch.cuda.Stream | None
    cache_geometry: CacheGeometry  # which layers run the indexer (GLM-5's shared layers do not)

    def set_pending_backup(self, event: torch.cuda.Event | None, rows: list[int] | None = None) -> None:
        """Record the newest backup (and the request rows whose rows it copies)."""

    def wait_backup_on_current_stream(self) -> None:
        """Make the current stream wait for the last backup."""


class HiSparseBackend(AttentionBackend):
    def __init__(self, coordinator: HiSparseMemory, prefetch_shared_layers: bool = False,
                 early_swap_in: bool = False, side_stream_copy_blocks: int | str = 0,
                 speculative_prefetch: bool = False) -> None:  # fmt: skip
        """`prefetch_shared_layers`: start GLM-5 shared layers' swap-ins at their full layer (a no-op for models
        without shared layers); `early_swap_in`: start a layer's own swap-in in `prepare_attention` rather than in
        its attention; `speculative_prefetch`: each full layer also swaps its top-k into the next full layer's
        buffer, as a bet (decode_server/hisparse/prefetch.py); `side_stream_copy_blocks`: cap the copy kernel's
        grid of the swap-ins that those run on the side stream (0: no cap; "auto": by the batch)."""
        self.co = coordinator
        self._batch: ForwardBatch | None = None
        self._query_rows: torch.Tensor | None = None
        self._index_rows: torch.Tensor | None = None
        self._token_rows: torch.Tensor | None = None  # the indexer's [B, width] key rows, one gather a forward
        self._query_lens: torch.Tensor | None = None  # positions + 1: what each query sees, made once a forward
        self._new_slots: torch.Tensor | None = None  # decode: device slot of each new token
        self._new_host_rows: torch.Tensor | None = None  # decode: host row of each new token
        self._extend_host_rows_cpu: torch.Tensor | None = None  # prefill: host rows of the new tokens
        self._seq_lens: torch.Tensor | None = None  # decode: seq_lens of the batch, made once per forward
        self._staging_active = False  # prefill: this forward runs on the device staging area
        self._warned_staging = False
        self.staged_prefill_forwards = 0  # prefill forwards on the staging area / on the reference gather path
        self.gathered_prefill_forwards = 0
        # One bound swap-in per layer (tables, pools and counters bound once): without CUDA graphs the swap-in's host
        # time is on the step's critical path, once per layer (docs/kernels.md). A profiler may wrap the entries.
        bufs = coordinator.buffers
        self.swaps = [self._bind_swap_in(layer, coordinator.counters.swap[layer]) for layer in range(bufs.num_layers)]
        followers = shared_followers(coordinator.cache_geometry) if prefetch_shared_layers else {}
        bets = next_full_layers(coordinator.cache_geometry) if speculative_prefetch else {}
        # The bets' swap-ins: the same tables, their own counters (a layer's hit rate stays its selections'). They
        # always run on the side stream, so their copies take the cap.
        self.speculative_swaps = [
            self._bind_swap_in(layer, coordinator.counters.speculative[layer], side_stream_copy_blocks)
            if layer in bets.values() else None
            for layer in range(bufs.num_layers)
        ]
        self.prefetch = SwapInPrefetch(followers, self.swaps, coordinator.device, early=early_swap_in,
                                       speculative=bets, speculative_swaps=self.speculative_swaps)
        # The layers whose decode swap-ins run on the side stream, beside the forward's kernels: all of them with
        # the early swap-in, else the shared followers. Their copies take only a capped share of the SMs.
        side_layers = range(bufs.num_layers) if early_swap_in else [f for fs in followers.values() for f in fs]
        for layer in side_layers:
            self.swaps[layer].max_copy_blocks = side_stream_copy_blocks
        self._attention_rows = [attention_rows(bufs.kv[layer], coordinator.kv_dtype)
                                for layer in range(bufs.num_layers)]
        # Static decode batches (CUDA graphs): the new tokens' slots and host rows, written inside the forward
        # (so inside the graph), read by the backup after it. One entry per request row at most (rows
        # 0..scratch_row-1: the scratch row's index is the number of request rows).
        rows = bufs.scratch_row
        self._static_new_slots = torch.zeros(rows, dtype=torch.int64, device=coordinator.device)
        self._static_new_host_rows = torch.zeros(rows, dtype=torch.int64, device=coordinator.device)

    def _bind_swap_in(self, layer: int, counters: torch.Tensor, max_copy_blocks: int | str = 0) -> BoundSwapIn:
        """Layer `layer`'s swap-in with its tables bound once, counting into `counters`."""
        bufs, host = self.co.buffers, self.co.host
        swap = ops.bind_swap_in(SwapInTables(
            buffer_slots=bufs.buffer_slots, buffer_tokens=bufs.buffer_tokens[layer], lru_order=bufs.lru_order[layer],
            host_rows=host.rows.table, host_pool=host.kv[layer], device_pool=bufs.kv[layer],
            num_recent=bufs.num_recent, counters=counters,
        ))
        swap.max_copy_blocks = max_copy_blocks
        return swap

    @property
    def scratch_row(self) -> int:
        """The request row that padded rows of static decode batches use (forward_batch.SCRATCH_SLOTS)."""
        return self.co.buffers.scratch_row

    # -- per forward --
    def begin_forward(self, batch: ForwardBatch) -> None:
        co = self.co
        leftover = self.prefetch.pending_layers + self.prefetch.pending_bets
        if leftover:  # end_forward always joins, so this is a bug: never reuse them; joined, so the next forward runs
            self.prefetch.join()
            raise RuntimeError(f"prefetched swap-ins of layers {leftover} outlived their forward")
        if not batch.static:
            self.prepare_static_forward(batch)
        self._batch = batch
        self._query_rows = batch.req_rows[batch.token_req]
        self._index_rows = co.indexer.rows.table[self._query_rows, batch.positions].long()
        # Every layer's indexer reads the same rows: gathered once a forward, not once a layer; inside the
        # captured region under CUDA graphs (forward_context), so each replay gathers the step's rows.
        self._token_rows = co.indexer.rows.table[batch.req_rows, : batch.token_table_width()]
        self._query_lens = batch.indexer_query_lens()
        host_rows = co.host.rows.table[self._query_rows, batch.positions].long()
        if batch.is_decode:
            self._new_slots = self._slots_of_new_tokens(batch)
            self._new_host_rows = host_rows
            self._seq_lens = batch.seq_lens
            if batch.static:
                num = batch.batch_size
                self._static_new_slots[:num].copy_(self._new_slots)
                self._static_new_host_rows[:num].copy_(host_rows)
        else:
            self._begin_prefill(batch, host_rows)

    def _slots_of_new_tokens(self, batch: ForwardBatch) -> torch.Tensor:
        """Device slot of each request's new token (`DeviceBufferPool.slot_of_new_token`, on the device):
        LRU position t while t < D, else ring slot D + t mod R of the request's buffer."""
        bufs = self.co.buffers
        pos = batch.prefix_lens
        index = torch.where(pos < bufs.buffer_size, pos, bufs.buffer_size + pos % bufs.num_recent)
        return bufs.buffer_slots[batch.req_rows, index].long()

    def prepare_static_forward(self, batch: ForwardBatch) -> None:
        """The forward's stream waits for the last backup (on the GPU); decoding requests own a buffer."""
        co = self.co
        co.wait_backup_on_current_stream()
        if batch.is_decode:
            for row in batch.req_rows_cpu:
                if row != co.buffers.scratch_row and not co.buffers.has(row):
                    raise RuntimeError(f"request row {row} decodes without a device buffer")

    def finish_static_forward(self, batch: ForwardBatch, num_real: int) -> None:
        """Back up the real requests' new rows (padded rows are never backed up)."""
        if num_real:
            self._backup(self._static_new_slots[:num_real].clone(), self._static_new_host_rows[:num_real].clone(),
                         batch.req_rows_cpu[:num_real])

    def end_forward(self, batch: ForwardBatch) -> None:
        try:
            # Before the backup, inside the captured region for CUDA graphs: no side-stream work outlives the forward.
            self.prefetch.join()
            if (batch.is_decode and not batch.static and self._new_slots is not None
                    and self._new_host_rows is not None):
                self._backup(self._new_slots, self._new_host_rows, batch.req_rows_cpu)
            elif self._staging_active:
                self._staging_active = False
                # The staging area writes the chunk's new rows back to the host pool: a free or retraction of
                # these requests must wait for that write like for a decode backup.
                self.co.set_pending_backup(self.co.staging.finish(), batch.req_rows_cpu)
        finally:
            self._batch = None
            self._query_rows = self._index_rows = self._token_rows = self._query_lens = None
            self._new_slots = self._new_host_rows = self._extend_host_rows_cpu = self._seq_lens = None

    def _backup(self, slots: torch.Tensor, host_rows: torch.Tensor, req_rows: list[int]) -> None:
        co = self.co
        stream = co.backup_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(co.device))
        event = ops.backup_rows(co.buffers.kv, co.host.kv, slots, host_rows, stream=stream)
        co.set_pending_backup(event, req_rows)
        co.counters.add_d2h_all_layers(int(slots.numel()))

    def _current(self) -> ForwardBatch:
        if self._batch is None:
            raise RuntimeError("HiSparseBackend used outside a forward context")
        return self._batch

    def _as_row_bytes(self, kv_rows: torch.Tensor) -> torch.Tensor:
        """Model rows → pool bytes: the dtype's raw bytes, or packed 656-byte FP8 rows."""
        return encode_row_bytes(kv_rows, self.co.kv_dtype)

    # -- AttentionBackend --
    def write_kv(self, layer_id: int, kv_rows: torch.Tensor) -> None:
        batch = self._current()
        data = self._as_row_bytes(kv_rows)
        if batch.is_decode:
            self.co.buffers.kv[layer_id, self._new_slots] = data
        elif self._staging_active:
            self.co.staging.write(layer_id, data)
            self.co.counters.rows_d2h[layer_id] += int(data.shape[0])
        else:
            assert self._extend_host_rows_cpu is not None
            self.co.host.kv[layer_id].index_copy_(0, self._extend_host_rows_cpu, data.cpu())
            self.co.counters.rows_d2h[layer_id] += int(data.shape[0])

    def write_index_keys(self, layer_id: int, keys_fp8: torch.Tensor, scales: torch.Tensor) -> None:
        self._current()
        index = self.co.index_slot[layer_id]
        ops.write_index_rows(self.co.indexer.keys[index], self.co.indexer.scales[index], self._index_rows, keys_fp8,
                             scales)

    def index_topk(self, layer_id: int, q: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        batch = self._current()
        assert self._token_rows is not None and self._query_lens is not None  # set with the batch in begin_forward
        index = self.co.index_slot[layer_id]
        # As dense: the write above is the kernel right before, the tables were made in begin_forward, and padded
        # rows see 0 positions, so their selection is all -1.
        return ops.indexer_topk(
            q, weights, self.co.indexer.keys[index], self.co.indexer.scales[index],
            self._token_rows, batch.token_req, self._query_lens, top_k, self.co.reference_kernels,
            tables_ready=True,
        )

    def prepare_attention(self, layer_id: int, topk_positions: torch.Tensor) -> None:
        batch = self._current()
        if not (batch.is_decode and self.prefetch.early) or layer_id in self.prefetch.pending_layers:
            return  # prefill, early swap-in off, or a shared layer whose full layer already launched it
        # This layer's swap-in (and its shared followers') now, on the side stream: its attention takes the slots
        # after the model's query and KV-row projections, which run meanwhile.
        self.prefetch.launch(layer_id, topk_positions, self._swap_in_topk(topk_positions), self._seq_lens,
                             batch.req_rows, include_self=True)

    @staticmethod
    def _swap_in_topk(positions: torch.Tensor) -> torch.Tensor:
        """The top-k in the form the swap-in takes (int32, contiguous)."""
        if positions.dtype != torch.int32 or not positions.is_contiguous():
            return positions.to(torch.int32).contiguous()
        return positions

    def sparse_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        batch = self._current()
        if batch.is_decode:
            return self._decode_attention(layer_id, q, topk_positions, softmax_scale)
        return self._extend_attention(layer_id, q, topk_positions, softmax_scale)

    def _decode_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        batch = self._current()
        co = self.co
        source = topk_positions
        # Started early: by this layer's prepare_attention (early_swap_in) or by its full layer (a GLM-5 shared layer).
        slots = self.prefetch.take(layer_id, source)
        if slots is None:
            topk_positions = self._swap_in_topk(topk_positions)
            # The full layer's own swap-in first (its attention waits for it; it waits for the bet on its
            # selection that the full layer before made), then its followers' and the next bet on the side.
            self.prefetch.before_own_swap_in(layer_id)
            slots = self.swaps[layer_id](topk_positions, self._seq_lens, batch.req_rows)
            self.prefetch.launch(layer_id, source, topk_positions, self._seq_lens, batch.req_rows)
        return ops.sparse_attention(q, self._attention_rows[layer_id], slots, softmax_scale, co.kv_lora_rank,
                                    co.reference_kernels, kernel=self.attention_kernel)

    # -- prefill --
    def _begin_prefill(self, batch: ForwardBatch, host_rows: torch.Tensor) -> None:
        co = self.co
        staging = co.staging
        if staging is not None and staging.fits(batch):
            staging.begin(batch, co.host.kv, co.host.rows, host_rows)
            self._staging_active = True
            self.staged_prefill_forwards += 1
            return
        if staging is not None and not self._warned_staging:
            self._warned_staging = True
            logger.warning("a prefill batch of %d tokens (prefixes included) exceeds the prefill staging area "
                           "(%d rows): such batches gather their rows from the host pool (slower)",
                           sum(batch.seq_lens_cpu), staging.capacity)
        self._extend_host_rows_cpu = host_rows.cpu()
        self.gathered_prefill_forwards += 1

    def _extend_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Prefill: attention over the device staging area (or the reference gather path)."""
        if not self._staging_active:
            return self._extend_attention_gather(layer_id, q, topk_positions, softmax_scale)
        co = self.co
        staging = co.staging
        rows = staging.rows(layer_id)
        out = ops.sparse_attention(q, attention_rows(rows, co.kv_dtype), staging.indices(topk_positions),
                                   softmax_scale, co.kv_lora_rank, co.reference_kernels, kernel=self.attention_kernel)
        staging.done(layer_id)
        co.counters.add_h2d(layer_id, staging.prefix_rows)
        return out

    def _extend_attention_gather(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        """Reference prefill: gather each distinct selected row once from the host pool into a dense scratch
        tensor (a device sync and a CPU gather per layer; used when the batch does not fit the staging area)."""
        co = self.co
        valid = topk_positions >= 0
        safe = topk_positions.clamp(min=0).long()
        host_rows = co.host.rows.table[self._query_rows.unsqueeze(1), safe].long()
        host_rows = torch.where(valid, host_rows, torch.full_like(host_rows, -1))
        unique_rows, inverse = torch.unique(host_rows, return_inverse=True)
        # unique() sorts, so a −1 (padding) is first when present; gather only the real rows.
        has_pad = bool(unique_rows.numel()) and int(unique_rows[0]) < 0
        real_rows = unique_rows[1:] if has_pad else unique_rows
        scratch = co.host.kv[layer_id][real_rows.cpu()].to(co.device, non_blocking=True)
        co.counters.add_h2d(layer_id, int(real_rows.numel()))
        local = inverse - 1 if has_pad else inverse
        local = torch.where(valid, local, torch.full_like(local, -1)).to(torch.int32)
        return ops.sparse_attention(q, attention_rows(scratch, co.kv_dtype), local, softmax_scale, co.kv_lora_rank,
                                    co.reference_kernels, kernel=self.attention_kernel)
