"""Dense-mode KV manager: every token's MLA row and indexer key on the device (`DenseBackend`).

Admission reserves the request's full length (prompt + max_tokens), so a running request can always finish
and dense mode never retracts; requests that do not fit yet wait in the queue.
"""

from __future__ import annotations

import torch

from decode_server.engine.dense_backend import DenseBackend, DenseKVCache
from decode_server.engine.kv_alloc import PagedAllocator
from decode_server.engine.kv_manager import KVManager
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.engine.types import PoolUsage


class DenseKVManager(KVManager):
    supports_retraction = False

    def __init__(
        self, num_layers: int, num_slots: int, max_reqs: int, max_ctx: int, kv_dtype: torch.dtype,
        device: torch.device, page_size: int, geometry: CacheGeometry | None = None, reference_kernels: bool = False,
    ) -> None:
        self.cache = DenseKVCache(num_layers, num_slots, max_reqs, max_ctx, kv_dtype, device, page_size, geometry)
        self.backend = DenseBackend(self.cache, reference_kernels)
        self.max_ctx = max_ctx

    @property
    def _alloc(self) -> PagedAllocator:
        return self.cache.allocator

    def capacity_error(self, prompt_len: int, max_total_len: int) -> str | None:
        if max_total_len > self.max_ctx:
            return f"{max_total_len} tokens exceed the engine's context length {self.max_ctx}"
        need = self._alloc.pages_for(max_total_len)
        if need > self._alloc.num_pages:
            return (f"needs {need} KV pages of {self._alloc.page_size} tokens for {max_total_len} tokens; "
                    f"the device KV cache has {self._alloc.num_pages}")
        return None

    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int) -> bool:
        if not self._alloc.can_allocate(self.cache.tokens.pages_needed(req_row, max_total_len)):
            return False
        self.backend.reserve(req_row, max_total_len)
        return True

    def ensure_room(self, req_row: int, num_tokens: int) -> bool:
        need = self.cache.tokens.pages_needed(req_row, num_tokens)
        if need and not self._alloc.can_allocate(need):
            return False
        self.backend.reserve(req_row, num_tokens)
        return True

    def free(self, req_row: int) -> None:
        self.backend.release(req_row)

    def usage(self) -> dict[str, PoolUsage]:
        ps = self._alloc.page_size
        return {"dense_kv_slots": PoolUsage(used=self._alloc.num_used_pages * ps, total=self._alloc.num_slots)}

    def token_usage(self) -> float:
        return self.usage()["dense_kv_slots"].fraction

    def is_empty(self) -> bool:
        return self._alloc.num_used_pages == 0
