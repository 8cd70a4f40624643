"""Where a PD request's KV lives on each side: the regions the transfer engine reads (prefill) and writes
(decode), and the decode side's hand-over of arrived rows to the engine's pools.

Three regions travel for every prompt token, with the same names on both sides: `kv` (the MLA row, as the KV
dtype stores it), `index_keys` (128 FP8 indexer-key values) and `index_scales` (its fp32 scale). A region is a
`[layers, rows, ...]` tensor; a token's data in one layer is one row, and one row index names the token's place
in all three regions (so one destination row list serves them all).

- Prefill (dense KV on its device): the regions are the dense cache's own tensors; a request's rows are its
  cache slots.
- Decode with HiSparse: `kv` is the host KV pool itself (rows written where decode reads them; nothing is copied
  afterwards); `index_keys`/`index_scales` are a host staging area with the host pool's row numbering, copied
  into the GPU indexer cache when the request is admitted into the decode batch.
- Decode without HiSparse: all three regions are a host staging area (paged, its own allocator) copied into the
  device cache on admission.
- Aux: one `AUX_RECORD_BYTES` row per request row of the engine (a request holds its row while its KV arrives).
All decode regions are allocated once at start and registered with the transfer engine once.

A tensor-parallel decode server (`--tp-size N` without DP attention) receives each prompt's KV once, on rank 0:
its staging areas are shared-memory regions every rank maps (decode_server/hisparse/shared_host.py, like the
HiSparse host pool, which is shared already), so every rank installs the same arrived rows into its own device
from them. Only rank 0 registers them with its transfer engine (decode_server/disagg/decode_role.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from decode_server.disagg.aux_record import AUX_RECORD_BYTES
from decode_server.engine.dense_kv import DenseKVManager
from decode_server.engine.kv_alloc import PagedAllocator
from decode_server.engine.kv_manager import KVManager
from decode_server.engine.pinned import host_empty
from decode_server.engine.types import PoolUsage
from decode_server.hisparse.coordinator import HiSparseCoordinator
from decode_server.hisparse.shared_host import allocate_shared_host
from kernels.indexer_ref import INDEX_HEAD_DIM

logger = logging.getLogger(__name__)

REGION_NAMES = ("kv", "index_keys", "index_scales")


@dataclass(frozen=True)
class RegionView:
    """A `[layers, rows, ...]` tensor seen as bytes: base address, bytes between layers, bytes per row."""

    name: str
    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if not self.tensor.is_contiguous():
            raise ValueError(f"region {self.name} must be contiguous")

    @property
    def base_ptr(self) -> int:
        return int(self.tensor.data_ptr())

    @property
    def num_layers(self) -> int:
        return int(self.tensor.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.tensor.shape[1])

    @property
    def layer_stride_bytes(self) -> int:
        return int(self.tensor.stride(0)) * self.tensor.element_size()

    @property
    def row_bytes(self) -> int:
        return int(self.tensor.stride(1)) * self.tensor.element_size()

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def as_rows(self) -> torch.Tensor:
        """The same memory as `[layers, rows, row_bytes]` uint8."""
        return self.tensor.view(torch.uint8).reshape(self.num_layers, self.num_rows, self.row_bytes)


def prefill_regions(kv: KVManager) -> dict[str, RegionView]:
    """The prefill engine's dense cache as transfer source regions."""
    if not isinstance(kv, DenseKVManager):
        raise ValueError("a prefill server keeps its KV dense (run it without --enable-hisparse)")
    cache = kv.cache
    return {
        "kv": RegionView("kv", cache.kv),
        "index_keys": RegionView("index_keys", cache.index_keys),
        "index_scales": RegionView("index_scales", cache.index_scales),
    }


def prefill_rows(kv: KVManager, req_row: int, start: int, num_tokens: int) -> list[int]:
    """Cache slots of tokens [start, start + num_tokens) of a prefill request."""
    assert isinstance(kv, DenseKVManager)
    return kv.cache.tokens.table[req_row, start : start + num_tokens].tolist()


class DecodeMemory:
    """The decode engine's receiving memory: regions for the transfer engine, destinations, hand-over."""

    def __init__(self, kv: KVManager, max_requests: int, parallel: Any = None) -> None:
        """`parallel`: the ranks of a tensor-parallel decode server (collective: every rank builds its memory in
        the same order), or None for one rank."""
        self.kv = kv
        device = _device_of(kv)
        pin = torch.cuda.is_available() and device.type == "cuda"
        self.shared = parallel is not None and parallel.tp_size > 1

        def staging(shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
            if not self.shared:
                return host_empty(shape, dtype, device, what)
            row_bytes = shape[-1] * dtype.itemsize if len(shape) > 2 else dtype.itemsize
            flat = allocate_shared_host((shape[0], shape[1], row_bytes), parallel, device, what=f"shared {what}")
            return flat.view(dtype).view(shape)

        self.aux = torch.zeros((max_requests, AUX_RECORD_BYTES), dtype=torch.uint8, pin_memory=pin)
        self._staging_rows: dict[int, list[int]] = {}  # dense: req_row -> staging rows it holds
        self._staging_pages: dict[int, list[int]] = {}
        if isinstance(kv, HiSparseCoordinator):
            host = kv.host
            num_layers, num_rows = host.kv.shape[0], host.kv.shape[1]
            self.staging_alloc: PagedAllocator | None = None
            self.stage_kv: torch.Tensor | None = None
            self.stage_keys = staging((num_layers, num_rows, INDEX_HEAD_DIM), torch.float8_e4m3fn,
                                      "PD index-key staging")
            self.stage_scales = staging((num_layers, num_rows), torch.float32, "PD index-scale staging")
            self.regions = {
                "kv": RegionView("kv", host.kv),
                "index_keys": RegionView("index_keys", self.stage_keys),
                "index_scales": RegionView("index_scales", self.stage_scales),
            }
        elif isinstance(kv, DenseKVManager):
            cache = kv.cache
            num_layers, num_rows = cache.kv.shape[0], cache.kv.shape[1]
            # As many rows as the device cache: the prompts of admitted requests always fit.
            self.staging_alloc = PagedAllocator(num_rows, cache.allocator.page_size, name="PD staging")
            self.stage_kv = staging(tuple(cache.kv.shape), cache.kv.dtype, "PD KV staging")
            self.stage_keys = staging(tuple(cache.index_keys.shape), cache.index_keys.dtype, "PD index-key staging")
            self.stage_scales = staging(tuple(cache.index_scales.shape), torch.float32, "PD index-scale staging")
            self.regions = {
                "kv": RegionView("kv", self.stage_kv),
                "index_keys": RegionView("index_keys", self.stage_keys),
                "index_scales": RegionView("index_scales", self.stage_scales),
            }
        else:
            raise ValueError(f"no PD decode memory for {type(kv).__name__}")
        self.aux_region = RegionView("aux", self.aux)
        logger.info("PD decode memory: %s; aux %d rows x %d B",
                    ", ".join(f"{r.name} {r.nbytes / 2**20:.1f} MiB" for r in self.regions.values()),
                    max_requests, AUX_RECORD_BYTES)  # fmt: skip

    # -- per request --
    def destination(self, req_row: int, num_tokens: int) -> list[int]:
        """Rows (in every region) where tokens 0..num_tokens-1 of an admitted request must be written; clears
        its aux row."""
        self.aux[req_row].zero_()
        if isinstance(self.kv, HiSparseCoordinator):
            return self.kv.host.rows.slots(req_row, num_tokens).tolist()
        assert self.staging_alloc is not None
        ps = self.staging_alloc.page_size
        pages = self.staging_alloc.allocate(self.staging_alloc.pages_for(num_tokens))
        rows = [p * ps + i for p in pages for i in range(ps)][:num_tokens]
        self._staging_rows[req_row] = rows
        self._staging_pages[req_row] = pages
        return rows

    def read_aux(self, req_row: int) -> bytes:
        return self.aux[req_row].numpy().tobytes()

    def install(self, req_row: int, num_tokens: int) -> None:
        """Move the arrived rows to where the engine reads them (indexer keys to the device; dense: the KV rows
        too) and give back the staging rows."""
        kv = self.kv
        if isinstance(kv, HiSparseCoordinator):
            src = kv.host.rows.slots(req_row, num_tokens).cpu().long()
            dst = kv.indexer.rows.slots(req_row, num_tokens).long()
            kv.indexer.keys[:, dst] = self.stage_keys[:, src].to(kv.device, non_blocking=True)
            kv.indexer.scales[:, dst] = self.stage_scales[:, src].to(kv.device, non_blocking=True)
            return
        assert isinstance(kv, DenseKVManager) and self.stage_kv is not None
        cache = kv.cache
        src = torch.tensor(self._staging_rows[req_row], dtype=torch.int64)
        dst = cache.tokens.table[req_row, :num_tokens].long()
        cache.kv[:, dst] = self.stage_kv[:, src].to(cache.device, non_blocking=True)
        cache.index_keys[:, dst] = self.stage_keys[:, src].to(cache.device, non_blocking=True)
        cache.index_scales[:, dst] = self.stage_scales[:, src].to(cache.device, non_blocking=True)
        if cache.device.type == "cuda":
            torch.cuda.current_stream(cache.device).synchronize()  # staging rows are reused once released
        self.release(req_row)

    def release(self, req_row: int) -> None:
        """Give back the staging rows of a request (after install, failure or abort); idempotent."""
        self._staging_rows.pop(req_row, None)
        pages = self._staging_pages.pop(req_row, None)
        if pages and self.staging_alloc is not None:
            self.staging_alloc.free(pages)

    # -- accounting --
    def staging_usage(self) -> PoolUsage:
        if self.staging_alloc is None:
            return PoolUsage()
        ps = self.staging_alloc.page_size
        return PoolUsage(used=self.staging_alloc.num_used_pages * ps, total=self.staging_alloc.num_slots)


def _device_of(kv: KVManager) -> torch.device:
    if isinstance(kv, HiSparseCoordinator):
        return kv.device
    assert isinstance(kv, DenseKVManager)
    return kv.cache.device
