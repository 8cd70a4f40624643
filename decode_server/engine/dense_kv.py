"""Dense-mode KV manager: every token's MLA row and indexer key on the device (`DenseBackend`).

KV grows a page at a time: admission takes pages for the prompt and the first generated token, each decode step
adds a page when the request crosses a page boundary. When a page is missing the scheduler retracts a request:
its rows and indexer keys are copied to (pageable) host memory and its device pages freed; on resume they are
copied back into newly allocated pages. Nothing is recomputed, so the request's tokens and logits are the same
bits as without the retraction (recomputing the KV with a prefill would run different GEMM shapes and could
change the logits, hence greedy tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from decode_server.engine.dense_backend import DenseBackend, DenseKVCache
from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable
from decode_server.engine.kv_manager import KVManager
from decode_server.engine.kv_rows import CacheGeometry
from decode_server.engine.types import PoolUsage


class DenseKVManager(KVManager):
    supports_retraction = True

    def __init__(
        self, num_layers: int, num_slots: int, max_reqs: int, max_ctx: int, kv_dtype: torch.dtype,
        device: torch.device, page_size: int, geometry: CacheGeometry | None = None, reference_kernels: bool = False,
    ) -> None:
        self.cache = DenseKVCache(num_layers, num_slots, max_reqs, max_ctx, kv_dtype, device, page_size, geometry)
        self.backend = DenseBackend(self.cache, reference_kernels)
        self.max_ctx = max_ctx
        # Retracted requests: their rows, indexer keys and scales, in host memory.
        self._saved: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def _alloc(self) -> PagedAllocator:
        return self.cache.allocator

    @property
    def page_size(self) -> int:
        return self._alloc.page_size

    def token_tables(self) -> list[RequestTokenTable]:
        return [self.cache.tokens]

    @property
    def max_request_tokens(self) -> int:
        return min(self.max_ctx, self._alloc.num_slots)

    def capacity_error(self, prompt_len: int, max_total_len: int) -> str | None:
        if max_total_len > self.max_ctx:
            return f"{max_total_len} tokens exceed the engine's context length {self.max_ctx}"
        need = self._alloc.pages_for(max_total_len)
        if need > self._alloc.num_pages:
            return (f"needs {need} KV pages of {self._alloc.page_size} tokens for {max_total_len} tokens; "
                    f"the device KV cache has {self._alloc.num_pages}")
        return None

    def free_pages(self) -> int:
        return self._alloc.num_free_pages + self._evictable_pages()

    def pages_needed(self, req_row: int, num_tokens: int) -> int:
        return self.cache.tokens.pages_needed(req_row, num_tokens)

    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int,
                  prompt_ids: Sequence[int] | None = None) -> bool:
        self._attach_prefix(req_row, prompt_ids)
        if self.ensure_room(req_row, min(prompt_len + 1, max_total_len)):
            self._admitted(req_row, prompt_ids)
            return True
        self._release_tables(req_row, None)  # gives the cached prefix back
        return False

    def ensure_room(self, req_row: int, num_tokens: int) -> bool:
        need = self.cache.tokens.pages_needed(req_row, num_tokens)
        if need:
            self._make_room(req_row, num_tokens)
            if not self._alloc.can_allocate(need):
                return False
        self.backend.reserve(req_row, num_tokens)
        return True

    def retract(self, req_row: int, num_tokens: int) -> None:
        """Copy the request's first `num_tokens` rows (MLA + indexer) to host memory and free its pages."""
        cache = self.cache
        slots = cache.tokens.slots(req_row, num_tokens).long()
        self._saved[req_row] = (cache.kv[:, slots].cpu(), cache.index_keys[:, slots].cpu(),
                                cache.index_scales[:, slots].cpu())
        self._release_tables(req_row, None)

    def try_resume(self, req_row: int, num_tokens: int) -> bool:
        """Pages for `num_tokens` + 1 tokens, then the saved rows copied back; False (nothing taken) if short."""
        if not self.ensure_room(req_row, num_tokens + 1):
            return False
        kv, keys, scales = self._saved.pop(req_row)
        cache = self.cache
        slots = cache.tokens.slots(req_row, num_tokens).long()
        cache.kv[:, slots] = kv.to(cache.device)
        cache.index_keys[:, slots] = keys.to(cache.device)
        cache.index_scales[:, slots] = scales.to(cache.device)
        return True

    def free(self, req_row: int, token_ids: Sequence[int] | None = None) -> None:
        self._saved.pop(req_row, None)
        self._release_tables(req_row, token_ids)

    def usage(self) -> dict[str, PoolUsage]:
        ps = self._alloc.page_size
        return {"dense_kv_slots": PoolUsage(used=self._alloc.num_used_pages * ps, total=self._alloc.num_slots)}

    def token_usage(self) -> float:
        """Like SGLang's: cached pages that no request maps count as free."""
        return (self._alloc.num_used_pages - self._evictable_pages()) / self._alloc.num_pages

    def is_empty(self) -> bool:
        cached = self.prefix.cache.num_nodes if self.prefix is not None else 0
        idle_cache = self.prefix is None or self.prefix.is_idle()
        return self._alloc.num_used_pages == cached and idle_cache and not self._saved
