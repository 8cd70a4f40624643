"""What the scheduler asks of KV memory, whatever the mode: admit, grow, retract, resume, free, report.

Two implementations: `DenseKVManager` (all KV on the device) and
`decode_server.hisparse.coordinator.HiSparseCoordinator` (host pool + device buffers + GPU indexer keys). In both,
KV grows page by page with the sequence: admission takes pages for the prompt and the first generated token,
`ensure_room` adds a page when a request needs one, and a request that cannot get one is retracted (its KV moved
out of the budgeted pools into private host memory) and resumed later, bit for bit, without recomputation.
Both expose the `AttentionBackend` the model uses.

Prefix caching (`enable_prefix_cache`, decode_server/engine/prefix_sharing.py): admission maps the longest cached
prefix of the prompt into the request's tables (its KV is not recomputed), allocations evict unlocked cached
pages when a pool is short, and a request that ends donates its full pages to the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from decode_server.engine.attention_backend import AttentionBackend
from decode_server.engine.kv_alloc import RequestTokenTable
from decode_server.engine.prefix_sharing import PrefixSharing
from decode_server.engine.types import HiSparseLayerStats, PoolUsage, PrefixCacheStats


class KVManager(ABC):
    backend: AttentionBackend
    supports_retraction: bool = False
    prefix: PrefixSharing | None = None  # prefix caching on (enable_prefix_cache)

    @abstractmethod
    def token_tables(self) -> list[RequestTokenTable]:
        """The per-token tables of the pools that grow with a request, in a fixed order (what a cached page spans)."""

    def enable_prefix_cache(self, align_tokens: int) -> None:
        """Turn prefix caching on (before any request): `align_tokens` as in `PrefixSharing`."""
        if any(t.num_requests for t in self.token_tables()):
            raise RuntimeError("prefix caching must be enabled before the first request")
        self.prefix = PrefixSharing(self.token_tables(), align_tokens)

    def cached_prefix_tokens(self, prompt_ids: Sequence[int]) -> int:
        """Tokens of this prompt that admission would find cached now (0 without prefix caching)."""
        return self.prefix.lookup(prompt_ids).num_tokens if self.prefix is not None else 0

    @property
    def prefix_cache_version(self) -> int:
        """Changes whenever the prefix cache gains or loses a page: `cached_prefix_tokens` of a prompt stays valid
        while it does not."""
        return self.prefix.cache.version if self.prefix is not None else 0

    def cached_tokens(self, req_row: int) -> int:
        """Tokens at the head of `req_row` whose pages the prefix cache holds; read right after `try_admit`, the
        prompt's reused prefix (its prefill starts after them)."""
        return self.prefix.cached_tokens(req_row) if self.prefix is not None else 0

    def cache_prompt(self, req_row: int, prompt_ids: Sequence[int]) -> None:
        """Prefill done: the prompt's full pages join the prefix cache (lent back to the request)."""
        if self.prefix is not None:
            self.prefix.share_prompt(req_row, prompt_ids)

    def flush_prefix_cache(self) -> int:
        """Drop every cached page no request maps (SGLang's /flush_cache); returns the tokens dropped."""
        return self.prefix.flush() * self.page_size if self.prefix is not None else 0

    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        if self.prefix is None:
            return None
        cache = self.prefix.cache
        return PrefixCacheStats(
            cached_tokens=cache.num_cached_tokens, evictable_tokens=cache.num_evictable_pages * self.page_size,
            queried_tokens=cache.num_queried_tokens, hit_tokens=cache.num_hit_tokens,
            evicted_tokens=cache.num_evicted_pages * self.page_size, page_size=self.page_size)

    def _evictable_pages(self) -> int:
        return self.prefix.num_evictable_pages if self.prefix is not None else 0

    def _attach_prefix(self, req_row: int, prompt_ids: Sequence[int] | None) -> None:
        """Map the prompt's cached prefix into the empty row (nothing without prefix caching or prompt ids)."""
        if self.prefix is not None and prompt_ids is not None:
            self.prefix.attach(req_row, self.prefix.lookup(prompt_ids))

    def _admitted(self, req_row: int, prompt_ids: Sequence[int] | None) -> None:
        """`try_admit` succeeded: the prefix cache counts the prompt and what it reused."""
        if self.prefix is not None and prompt_ids is not None:
            self.prefix.count_admitted(req_row, len(prompt_ids))

    def _make_room(self, req_row: int, num_tokens: int) -> None:
        """Evict cached pages so that every table can grow `req_row` to `num_tokens` tokens, where they allow."""
        if self.prefix is not None:
            self.prefix.make_room([t.pages_needed(req_row, num_tokens) for t in self.token_tables()])

    def _release_tables(self, req_row: int, token_ids: Sequence[int] | None) -> None:
        """Unmap `req_row` everywhere: with prefix caching its full pages of `token_ids` go to the cache (None:
        none do), its borrowed prefix is unlocked; every other page it owns is freed."""
        if self.prefix is not None:
            self.prefix.release(req_row, token_ids)
        else:
            for table in self.token_tables():
                table.release(req_row)

    @abstractmethod
    def capacity_error(self, prompt_len: int, max_total_len: int) -> str | None:
        """Why a request of this size could never run, even alone; None when it can."""

    @property
    @abstractmethod
    def page_size(self) -> int:
        """Tokens per page of every growing pool."""

    @property
    @abstractmethod
    def max_request_tokens(self) -> int:
        """The most tokens (prompt + generated − 1) one request can ever hold, alone in the cache."""

    @abstractmethod
    def free_pages(self) -> int:
        """Free pages of the binding growing pool (the one with the fewest)."""

    @abstractmethod
    def pages_needed(self, req_row: int, num_tokens: int) -> int:
        """Pages `req_row` still lacks to hold `num_tokens` tokens (in the pool that lacks the most)."""

    def can_start_request(self) -> bool:
        """Whether the fixed per-request resources (HiSparse: a device buffer) are free now."""
        return True

    @abstractmethod
    def try_admit(self, req_row: int, prompt_len: int, max_total_len: int,
                  prompt_ids: Sequence[int] | None = None) -> bool:
        """Take what the request needs to prefill and sample its first token (pages for prompt + 1 tokens, and
        the fixed per-request resources); False = not now (nothing taken). With prefix caching and `prompt_ids`,
        the prompt's cached prefix is mapped first (`cached_tokens` says how long it is)."""

    @abstractmethod
    def ensure_room(self, req_row: int, num_tokens: int) -> bool:
        """Grow the request to hold `num_tokens` tokens; False when memory is short (the scheduler retracts)."""

    def finish_prefill(self, req_row: int, num_tokens: int) -> None:  # noqa: B027 - optional hook
        """The prompt's KV is complete: move it to where decode reads it (HiSparse: preload the buffer)."""

    def retract(self, req_row: int, num_tokens: int) -> None:
        raise RuntimeError(f"{type(self).__name__} does not retract")

    def try_resume(self, req_row: int, num_tokens: int) -> bool:
        raise RuntimeError(f"{type(self).__name__} does not retract")

    @abstractmethod
    def free(self, req_row: int, token_ids: Sequence[int] | None = None) -> None:
        """Release everything the request holds (finish and abort). `token_ids`: the tokens whose KV is complete
        in its pages, which prefix caching keeps (None: nothing is kept)."""

    @abstractmethod
    def usage(self) -> dict[str, PoolUsage]:
        """Pool name → usage; names are `EngineStats` fields."""

    @abstractmethod
    def token_usage(self) -> float:
        """Fraction of the binding pool in use (SGLang's `token_usage`)."""

    def layer_stats(self) -> list[HiSparseLayerStats]:
        return []

    @abstractmethod
    def is_empty(self) -> bool:
        """True when no request holds anything: nothing is allocated but the prefix cache's unlocked pages (the
        engine asserts it when idle in tests)."""
