"""Host KV pool: every token's MLA row of every running (or retracted) request, in pinned host memory.

One uint8 tensor `[L, N_host, row_bytes]` (pinned on CUDA so kernels can read it over UVA and the backup can
write it asynchronously), rows handed out in pages; `rows.table[req_row, p]` (a `RequestTokenTable`) is the host
row of token p in every layer.
"""

from __future__ import annotations

import logging

import torch

from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable

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
    ) -> None:
        pin = device.type == "cuda" and torch.cuda.is_available()
        num_rows = num_pages * page_size
        # Not zero-filled (tens of GiB take seconds to touch): every row is written (prefill or backup) before
        # anything reads it.
        self.kv = torch.empty((num_layers, num_rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
        self.rows = RequestTokenTable(PagedAllocator(num_rows, page_size, name="host KV"), max_reqs, max_ctx, device)
        self.row_bytes = row_bytes
        self.pinned = pin
        logger.info(
            "host KV pool: %d layers x %d rows x %d B = %.1f MiB (%s)",
            num_layers, num_rows, row_bytes, self.kv.numel() / 2**20, "pinned" if pin else "pageable",
        )

    @property
    def nbytes(self) -> int:
        return self.kv.numel()
