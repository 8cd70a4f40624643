"""GPU indexer-key cache for HiSparse: 128 FP8 values + one fp32 scale per token per layer (132 B).

The indexer scores every token of a request at every step, so these keys stay on the device for the whole
context (only MLA rows are tiered). Rows are paged per request like the host pool. Only the layers that run the
indexer have keys (`num_layers` here counts those; GLM-5's "shared" layers have none), and the head size is
the model's `index_head_dim` (128 for DeepSeek-V3.2 and GLM-5).
"""

from __future__ import annotations

import torch

from decode_server.engine.forward_batch import SCRATCH_SLOTS, map_scratch_row
from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable

INDEX_HEAD_DIM = 128
INDEX_KEY_BYTES = INDEX_HEAD_DIM + 4


class IndexerKeyPool:
    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, max_reqs: int, max_ctx: int, device: torch.device,
        head_dim: int = INDEX_HEAD_DIM,
    ) -> None:
        num_rows = num_pages * page_size
        # SCRATCH_SLOTS rows past the allocator's and one more table row: padded rows of static decode batches
        # write their keys there (forward_batch.SCRATCH_SLOTS).
        total = num_rows + SCRATCH_SLOTS
        self.keys = torch.zeros((num_layers, total, head_dim), dtype=torch.float8_e4m3fn, device=device)
        self.scales = torch.zeros((num_layers, total), dtype=torch.float32, device=device)
        self.rows = RequestTokenTable(
            PagedAllocator(num_rows, page_size, name="indexer keys"), max_reqs + 1, max_ctx, device
        )
        self.scratch_row = max_reqs
        map_scratch_row(self.rows.table, self.scratch_row, num_rows)

    @property
    def nbytes(self) -> int:
        return self.keys.numel() + self.scales.numel() * 4

    def save(self, req_row: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy a request's keys to host memory (before its rows are freed on retraction)."""
        rows = self.rows.slots(req_row, num_tokens).long()
        return self.keys[:, rows].cpu(), self.scales[:, rows].cpu()

    def restore(self, req_row: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Write keys saved by `save` back into the request's (newly allocated) rows."""
        keys, scales = saved
        rows = self.rows.slots(req_row, keys.shape[1]).long()
        self.keys[:, rows] = keys.to(self.keys.device)
        self.scales[:, rows] = scales.to(self.scales.device)
