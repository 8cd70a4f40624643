"""Host KV pool: every token's MLA row of every running (or retracted) request, in pinned host memory.

One uint8 tensor `[L, N_host, row_bytes]` (page-locked on CUDA, exactly its size (decode_server/engine/pinned.py),
so kernels can read it over UVA and the backup can write it asynchronously), rows handed out in pages;
`rows.table[req_row, p]` (a `RequestTokenTable`) is the host row of token p in every layer.

With tensor parallelism (`parallel.tp_size > 1`) the tensor is one shared-memory region of the node that every
rank maps (decode_server/hisparse/shared_host.py); each rank keeps its own page table, identical on every rank
because every rank schedules the same requests in the same order.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable
from decode_server.engine.pinned import host_empty
from decode_server.hisparse.shared_host import allocate_shared_host

logger = logging.getLogger(__name__)


class HostKVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        row_bytes: int,
        max_reqs: int,
        max_ctx: int,
        device: torch.device,
        parallel: Any = None,
    ) -> None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        num_rows = num_pages * page_size
        self.shared = parallel is not None and parallel.tp_size > 1
        # Every row is written (prefill or backup) before anything reads it: no initial values are needed (the
        # page-locked pool is zero-filled anyway, by host_empty, to fault its pages in on many threads).
        if self.shared:
            self.kv = allocate_shared_host((num_layers, num_rows, row_bytes), parallel, device)
        else:
            self.kv = host_empty((num_layers, num_rows, row_bytes), torch.uint8, device, "host KV pool")
        # One table row more than request rows: the scratch row of padded decode batches, which maps no host row
        # (its top-k is all -1 and its new token is never backed up: forward_batch.SCRATCH_SLOTS).
        self.scratch_row = max_reqs
        self.rows = RequestTokenTable(PagedAllocator(num_rows, page_size, name="host KV"), max_reqs + 1, max_ctx,
                                      device)
        self.row_bytes = row_bytes
        self.pinned = pin
        logger.info(
            "host KV pool: %d layers x %d rows x %d B = %.1f MiB (%s)",
            num_layers, num_rows, row_bytes, self.kv.numel() / 2**20,
            ("shared by the node's ranks, " if self.shared else "") + ("pinned" if pin else "pageable"),
        )

    @property
    def nbytes(self) -> int:
        return self.kv.numel()
