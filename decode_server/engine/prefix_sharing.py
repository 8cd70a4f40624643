"""A KV manager's side of prefix caching: map a cached prefix into a new request's tables, make room by evicting,
and give a finished request's pages to the cache (`decode_server/engine/prefix_cache.py` holds the tree).

A KV manager has one `RequestTokenTable` per pool that grows per token (dense: one, for MLA rows and indexer keys
alike; HiSparse: the host pool and the GPU indexer keys); a cached page is one page of each, so a request's
page i in every table holds the same tokens, and the tables are attached, grown, evicted and released in step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from decode_server.engine.kv_alloc import RequestTokenTable
from decode_server.engine.prefix_cache import PrefixCache, PrefixMatch


class PrefixSharing:
    def __init__(self, tables: Sequence[RequestTokenTable], align_tokens: int) -> None:
        """`align_tokens`: a reused prefix is a multiple of this many tokens (and of the page size). The page size
        by default; with deterministic inference the chunked-prefill size, so a request's prompt is still cut at
        the same multiples of its own tokens whatever was cached."""
        sizes = {t.allocator.page_size for t in tables}
        if len(sizes) != 1:
            raise ValueError(f"prefix caching needs one page size across the pools, got {sorted(sizes)}")
        self.tables = list(tables)
        self.page_size = sizes.pop()
        self.align = math.lcm(self.page_size, max(1, align_tokens))
        self.cache = PrefixCache(self.page_size, len(self.tables), self._free_evicted)
        self._matches: dict[int, PrefixMatch] = {}  # request row → the cached prefix it maps (locked)

    def _free_evicted(self, pool: int, pages: list[int]) -> None:
        self.tables[pool].allocator.free(pages)

    # -- admission --
    def lookup(self, token_ids: Sequence[int]) -> PrefixMatch:
        """The cached prefix a request with this prompt may reuse: whole pages, a multiple of `align`, and never
        the prompt's last token (its logits must be computed)."""
        limit = ((len(token_ids) - 1) // self.align) * self.align
        match = self.cache.match(token_ids, limit)
        usable = (match.num_tokens // self.align) * self.align // self.page_size
        return match if usable == len(match.nodes) else PrefixMatch(match.nodes[:usable], self.page_size)

    def attach(self, req_row: int, match: PrefixMatch) -> None:
        """Lock the prefix and map its pages first in every table of `req_row` (which holds nothing yet)."""
        self.cache.lock(match)
        for pool, table in enumerate(self.tables):
            table.adopt(req_row, match.pages(pool))
        self._matches[req_row] = match

    def count_admitted(self, req_row: int, prompt_len: int) -> None:
        """The request holding `req_row` was admitted (its prefix attached): count its prompt and what it reused
        (not at `attach`: an admission that fails for memory is tried again later)."""
        self.cache.count_lookup(prompt_len, self.cached_tokens(req_row))

    def share_prompt(self, req_row: int, prompt_ids: Sequence[int]) -> None:
        """The prompt's KV is complete (prefill done): its full pages join the cache now, lent back to the request,
        so requests admitted while it decodes reuse them (SGLang caches unfinished requests the same way). Stops
        at the first page the cache holds already (another request computed the same tokens meanwhile)."""
        match = self._matches.get(req_row, PrefixMatch((), self.page_size))
        pages = [table.pages_of(req_row) for table in self.tables]
        full = min(len(prompt_ids) // self.page_size, *(len(p) for p in pages))
        if full <= len(match.nodes):
            return
        taken = self.cache.insert(prompt_ids[: full * self.page_size], pages, match, stop_at_existing=True)
        if not taken:
            return
        path = self.cache.match(prompt_ids, (len(match.nodes) + len(taken)) * self.page_size)
        self.cache.lock(PrefixMatch(path.nodes[len(match.nodes):], self.page_size))
        self._matches[req_row] = path
        for table in self.tables:
            table.lend_head(req_row, len(path.nodes))

    def cached_tokens(self, req_row: int) -> int:
        """Tokens at the head of `req_row` whose pages the cache holds: right after `attach`, the reused prefix."""
        match = self._matches.get(req_row)
        return match.num_tokens if match is not None else 0

    # -- memory --
    def make_room(self, needs: Sequence[int]) -> None:
        """Evict unlocked cached pages until every pool has `needs[pool]` free pages; nothing when even evicting
        all of them would not do (the caller's allocation then fails as without a cache, and the cache is kept)."""
        short = max(need - table.allocator.num_free_pages for need, table in zip(needs, self.tables, strict=True))
        if 0 < short <= self.cache.num_evictable_pages:
            self.cache.evict(short)

    @property
    def num_evictable_pages(self) -> int:
        return self.cache.num_evictable_pages

    # -- the end of a request's use of its pages --
    def release(self, req_row: int, token_ids: Sequence[int] | None) -> None:
        """Unmap `req_row` in every table. `token_ids`: the tokens whose KV its pages hold, complete (finish,
        abort): its full pages the cache lacks are donated to it. None (retraction, whose rows were copied out):
        nothing is donated. Either way the prefix it borrowed is unlocked and its other pages are freed."""
        match = self._matches.pop(req_row, PrefixMatch((), self.page_size))
        detached = [table.detach(req_row) for table in self.tables]
        num_borrowed = len(match.nodes)
        if any(borrowed != num_borrowed for _, borrowed in detached):
            raise RuntimeError(f"row {req_row}: its tables borrowed {[b for _, b in detached]} pages, "
                               f"its prefix has {num_borrowed}")
        taken: list[bool] = []
        if token_ids is not None:
            full_pages = min(len(token_ids) // self.page_size, *(len(pages) for pages, _ in detached))
            taken = self.cache.insert(token_ids[: full_pages * self.page_size], [p for p, _ in detached], match)
        self.cache.unlock(match)
        for table, (pages, _) in zip(self.tables, detached, strict=True):
            own = pages[num_borrowed:]
            to_free = [page for i, page in enumerate(own) if i >= len(taken) or not taken[i]]
            if to_free:
                table.allocator.free(to_free)

    def flush(self) -> int:
        """Evict every unlocked cached page; returns how many pages (per pool) were freed."""
        return self.cache.flush()

    def is_idle(self) -> bool:
        """No request maps a cached page (what the tree holds then is evictable, not leaked)."""
        return not self._matches and self.cache.num_evictable_pages == self.cache.num_nodes
