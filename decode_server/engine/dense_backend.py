"""Dense attention backend: every token's KV row stays on the model's device (the baseline).

"Dense" names where the KV lives, not the attention: this backend runs the same DSA sparse attention over the
same indexer top-k as HiSparse; only the rows' home differs. HiSparse reuses it for colocated prefill.
"""

from __future__ import annotations

import torch

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.forward_batch import SCRATCH_SLOTS, ForwardBatch, map_scratch_row
from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable
from decode_server.engine.kv_rows import CacheGeometry, encode_rows, storage_layout
from decode_server.model import batch_invariant
from kernels import indexer_topk as _indexer_topk
from kernels import sparse_mla_decode as _sparse_mla
from kernels import write_index_rows
from kernels.dispatch import sparse_mla_decode_rows_ref
from kernels.indexer_ref import indexer_topk_ref
from kernels.sparse_mla_ref import D_V

# Upper bound on the gathered rows one attention call materializes (reference path), in bytes.
_ATTENTION_CHUNK_BYTES = 256 << 20


class DenseKVCache:
    """Per-layer MLA rows and indexer keys for `num_slots` tokens, plus the request→slot table.

    `kv` is `[L, N, 576]` of a float KV dtype, or `[L, N, 656]` uint8 FlashMLA FP8 rows when `kv_dtype` is
    `torch.float8_e4m3fn` (decode_server/engine/kv_rows.py); other MLA sizes come from `geometry` (default:
    DeepSeek-V3.2). Indexer keys exist only for the layers that run the indexer (`geometry.index_layers`).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_requests: int,
        max_context: int,
        kv_dtype: torch.dtype,
        device: torch.device | str,
        page_size: int = 64,
        geometry: CacheGeometry | None = None,
    ) -> None:
        self.geometry = geometry if geometry is not None else CacheGeometry(num_layers)
        if self.geometry.num_layers != num_layers:
            raise ValueError(f"geometry has {self.geometry.num_layers} layers, the cache {num_layers}")
        self.num_layers = num_layers
        self.index_slot = self.geometry.index_slots()
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        self.allocator = PagedAllocator(num_slots, page_size, name="dense KV")
        # One more table row than request rows and SCRATCH_SLOTS rows past the allocator's: padded rows of static
        # decode batches write there (forward_batch.SCRATCH_SLOTS).
        self.scratch_row = max_requests
        self.tokens = RequestTokenTable(self.allocator, max_requests + 1, max_context, self.device)
        self.scratch_slot = self.allocator.num_slots
        map_scratch_row(self.tokens.table, self.scratch_row, self.scratch_slot)
        n = self.allocator.num_slots + SCRATCH_SLOTS
        row_elems, elem_dtype = storage_layout(kv_dtype, self.geometry.row_dim)
        self.kv = torch.zeros((num_layers, n, row_elems), dtype=elem_dtype, device=self.device)
        num_index, index_dim = self.geometry.num_index_layers, self.geometry.index_head_dim
        self.index_keys = torch.zeros((num_index, n, index_dim), dtype=torch.float8_e4m3fn, device=self.device)
        self.index_scales = torch.zeros((num_index, n), dtype=torch.float32, device=self.device)

    @staticmethod
    def bytes_per_token(num_layers: int, kv_dtype: torch.dtype, geometry: CacheGeometry | None = None) -> int:
        """Device bytes one cached token costs: MLA rows of all layers + indexer keys (128 FP8 + fp32 scale) of
        the layers that run the indexer."""
        return (geometry if geometry is not None else CacheGeometry(num_layers)).bytes_per_token(kv_dtype)


class DenseBackend(AttentionBackend):
    """Writes new rows into the request's slots and attends over the top-k rows gathered from the cache.

    `reference_kernels`: run the PyTorch reference kernels even on CUDA (`--attention-backend torch_native`,
    for MLA / indexer sizes the GPU kernels do not support)."""

    def __init__(self, cache: DenseKVCache, reference_kernels: bool = False) -> None:
        self.cache = cache
        self.reference_kernels = reference_kernels
        self._batch: ForwardBatch | None = None
        self._new_slots: torch.Tensor | None = None
        self._query_rows: torch.Tensor | None = None
        self._token_rows: torch.Tensor | None = None  # the indexer's [B, width] slot rows, one gather a forward
        self._query_lens: torch.Tensor | None = None  # positions + 1: what each query sees, made once a forward

    @property
    def scratch_row(self) -> int:
        """The request row that padded rows of static decode batches use (forward_batch.SCRATCH_SLOTS)."""
        return self.cache.scratch_row

    # -- memory management (called by the scheduler, outside forward passes) --
    def reserve(self, req_row: int, num_tokens: int) -> None:
        self.cache.tokens.ensure(req_row, num_tokens)

    def release(self, req_row: int) -> None:
        self.cache.tokens.release(req_row)

    # -- AttentionBackend --
    def begin_forward(self, batch: ForwardBatch) -> None:
        if not batch.static:
            self.prepare_static_forward(batch)
        self._batch = batch
        self._query_rows = batch.req_rows[batch.token_req]
        self._new_slots = self.cache.tokens.table[self._query_rows, batch.positions].long()
        # Every layer's indexer reads the same rows: gathered once here rather than once a layer (at batch 64 and a
        # 160K context graphs' width that is ~42 MB a gather). Under CUDA graphs this runs inside the captured
        # region (forward_context), so each replay gathers the step's rows before the layers read them.
        self._token_rows = self.cache.tokens.table[batch.req_rows, : batch.token_table_width()]
        # Likewise the lengths the indexer's queries see (one add a forward instead of one a layer).
        self._query_lens = batch.indexer_query_lens()

    def prepare_static_forward(self, batch: ForwardBatch) -> None:
        """Every request of the batch (the scratch row aside) has slots for its tokens."""
        for row, seq_len in zip(batch.req_rows_cpu, batch.seq_lens_cpu, strict=True):
            if row != self.cache.scratch_row and self.cache.tokens.capacity(row) < seq_len:
                raise RuntimeError(f"request row {row}: {seq_len} tokens but only "
                                   f"{self.cache.tokens.capacity(row)} slots reserved")

    def end_forward(self, batch: ForwardBatch) -> None:
        self._batch = None
        self._new_slots = None
        self._query_rows = None
        self._token_rows = None
        self._query_lens = None

    def _current(self) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
        if self._batch is None or self._new_slots is None or self._query_rows is None:
            raise RuntimeError("DenseBackend used outside a forward context")
        return self._batch, self._new_slots, self._query_rows

    def write_kv(self, layer_id: int, kv_rows: torch.Tensor) -> None:
        _, slots, _ = self._current()
        self.cache.kv[layer_id, slots] = encode_rows(kv_rows, self.cache.kv_dtype)

    def write_index_keys(self, layer_id: int, keys_fp8: torch.Tensor, scales: torch.Tensor) -> None:
        _, slots, _ = self._current()
        index = self.cache.index_slot[layer_id]
        write_index_rows(self.cache.index_keys[index], self.cache.index_scales[index], slots, keys_fp8, scales)

    def index_topk(self, layer_id: int, q: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
        batch, _, _ = self._current()
        assert self._token_rows is not None and self._query_lens is not None  # set with the batch in begin_forward
        index = self.cache.index_slot[layer_id]
        # The write above is the kernel right before; the tables were made in begin_forward (tables_ready).
        # Padded rows see 0 positions (`_query_lens`): their selection is all -1 without a mask here.
        return indexer_topk(
            q, weights, self.cache.index_keys[index], self.cache.index_scales[index],
            self._token_rows, batch.token_req, self._query_lens, top_k, self.reference_kernels, tables_ready=True,
        )

    def physical_rows(self, topk_positions: torch.Tensor) -> torch.Tensor:
        """Map logical positions [T, K] (−1 pads) of the current batch's queries to cache slots."""
        _, _, query_rows = self._current()
        safe = topk_positions.clamp(min=0).long()
        slots = self.cache.tokens.table[query_rows.unsqueeze(1), safe]
        return torch.where(topk_positions >= 0, slots, torch.full_like(slots, -1))

    def sparse_attention(
        self, layer_id: int, q: torch.Tensor, topk_positions: torch.Tensor, softmax_scale: float
    ) -> torch.Tensor:
        slots = self.physical_rows(topk_positions)
        return attend_in_chunks(q, self.cache.kv[layer_id], slots, softmax_scale, self.cache.geometry.kv_lora_rank,
                                self.reference_kernels, kernel=self.attention_kernel)


def indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys_fp8: torch.Tensor, scales: torch.Tensor, token_rows: torch.Tensor,
    token_req: torch.Tensor, seq_lens: torch.Tensor, top_k: int, reference: bool = False, tables_ready: bool = False,
) -> torch.Tensor:
    """The indexer top-k dispatcher, or its PyTorch reference on any device when `reference` is set.
    tables_ready: token_rows, token_req and seq_lens were written before the kernel right before this call (the
    backends: in begin_forward), so the scores kernel may start early (kernels/indexer_fast.py; timing only)."""
    if reference:
        return indexer_topk_ref(q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, top_k)
    return _indexer_topk(q, weights, keys_fp8, scales, token_rows, token_req, seq_lens, top_k,
                         tables_ready=tables_ready)


def attend_in_chunks(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, softmax_scale: float, d_v: int = D_V,
    reference: bool = False, *, kernel: str = "triton",
) -> torch.Tensor:
    """Sparse MLA over physical slots → [T, H, d_v] (d_v = kv_lora_rank).

    On CUDA the Triton kernel reads rows in place, so the whole batch goes in one call (chunking it would only
    shrink the kernel's grid). The reference (CPU, or `reference` on any device) gathers the rows, so queries go
    in chunks that keep the gathered rows under a fixed size; each query's result depends only on its own rows,
    so chunking never changes a bit of the output.

    Batch-invariant mode (`--enable-deterministic-inference`): the Triton kernel runs with one split whatever the
    batch, and the reference on fixed tiles of `batch_invariant.ROW_TILE` queries (padded), so the kernels see the
    same shapes whatever else is in the batch.
    """
    if batch_invariant.enabled():
        return _attend_batch_invariant(q, kv, slots, softmax_scale, d_v, reference)
    if q.is_cuda and not reference:
        return _sparse_mla(q, kv, slots, softmax_scale, kernel=kernel)[0]
    num_q, top_k = slots.shape
    per_query = max(1, top_k * q.shape[-1] * 4 + q.shape[1] * top_k * 4)
    chunk = max(1, _ATTENTION_CHUNK_BYTES // per_query)
    outs = [sparse_mla_decode_rows_ref(q[i : i + chunk], kv, slots[i : i + chunk], softmax_scale, d_v)[0]
            for i in range(0, num_q, chunk)]
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def _attend_batch_invariant(
    q: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor, softmax_scale: float, d_v: int, reference: bool
) -> torch.Tensor:
    if q.is_cuda and not reference:
        from kernels.sparse_mla_triton import default_config, sparse_mla_decode_triton

        config = {**default_config(q.shape[1], kv.dtype == torch.uint8), "SPLITS": 1}
        return sparse_mla_decode_triton(q, kv, slots, softmax_scale, config)[0]
    tile = batch_invariant.ROW_TILE
    num_q = q.shape[0]
    pad = (-num_q) % tile or (tile if num_q == 0 else 0)
    if pad:
        q = torch.cat((q, q.new_zeros(pad, *q.shape[1:])))
        slots = torch.cat((slots, slots.new_full((pad, slots.shape[1]), -1)))
    outs = [sparse_mla_decode_rows_ref(q[i : i + tile], kv, slots[i : i + tile], softmax_scale, d_v)[0]
            for i in range(0, q.shape[0], tile)]
    return torch.cat(outs)[:num_q]
