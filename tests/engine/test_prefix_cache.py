"""The prefix cache's tree and its KV-manager glue on integers: matching, locking, LRU eviction, donation,
duplicates, the prompt shared at prefill's end, and the page accounting that must return to zero."""

from __future__ import annotations

import pytest

from decode_server.engine.kv_alloc import PagedAllocator, RequestTokenTable
from decode_server.engine.prefix_cache import PrefixCache, PrefixMatch
from decode_server.engine.prefix_sharing import PrefixSharing

PS = 4


def tables(num_pages: int = 32, pools: int = 2) -> list[RequestTokenTable]:
    return [RequestTokenTable(PagedAllocator(num_pages * PS, PS, name=f"pool{i}"), 8, 256, "cpu")
            for i in range(pools)]


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def run_request(sharing: PrefixSharing, row: int, prompt: list[int], total: int, *, share: bool = True) -> int:
    """Admit `prompt` into `row`, grow it to `total` tokens, share the prompt at prefill's end; returns the cached
    tokens it started from."""
    sharing.attach(row, sharing.lookup(prompt))
    sharing.count_admitted(row, len(prompt))
    cached = sharing.cached_tokens(row)
    sharing.make_room([t.pages_needed(row, total) for t in sharing.tables])
    for t in sharing.tables:
        t.ensure(row, total)
    if share:
        sharing.share_prompt(row, prompt)
    return cached


def used(sharing: PrefixSharing) -> list[int]:
    return [t.allocator.num_used_pages for t in sharing.tables]


def test_match_is_whole_pages_and_never_the_last_token():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    prompt = seq(100, 13)  # 3 full pages + 1 token
    assert run_request(sharing, 0, prompt, 14) == 0
    sharing.release(0, prompt + [7])  # 14 tokens: 3 full pages donated
    assert sharing.cache.num_cached_tokens == 12
    assert used(sharing) == [3, 3]
    assert sharing.lookup(prompt).num_tokens == 12
    assert sharing.lookup(prompt[:12]).num_tokens == 8  # the last token is computed again: its page is not reused
    assert sharing.lookup(prompt[:5] + [0] * 8).num_tokens == 4
    assert sharing.lookup([0] + prompt[1:]).num_tokens == 0  # a prefix: every earlier token must match


def test_reuse_maps_the_same_pages_and_frees_only_its_own():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    a = seq(0, 10)
    run_request(sharing, 0, a, 11)
    pages_a = [t.pages_of(0)[:2] for t in sharing.tables]
    sharing.release(0, a + [99])  # pages 0, 1 cached; page 2 (partial) freed
    assert used(sharing) == [2, 2]
    b = seq(0, 8) + [50, 51, 52]
    assert run_request(sharing, 1, b, 12) == 8
    assert [t.pages_of(1)[:2] for t in sharing.tables] == pages_a
    assert [t.num_borrowed(1) for t in sharing.tables] == [2, 2]
    # Retraction-style release (nothing donated): the cached pages stay, its own pages go back.
    sharing.release(1, None)
    assert used(sharing) == [2, 2]
    assert sharing.is_idle()
    assert sharing.flush() == 2
    assert used(sharing) == [0, 0]


def test_locked_prefixes_are_never_evicted_and_lru_goes_first():
    sharing = PrefixSharing(tables(num_pages=8), align_tokens=PS)
    old, new = seq(0, 9), seq(1000, 9)
    for row, prompt in enumerate((old, new)):
        run_request(sharing, row, prompt, 9)
        sharing.release(row, prompt)  # 2 full pages each cached
    assert sharing.cache.num_evictable_pages == 4
    run_request(sharing, 2, new[:8] + [5], 9)  # locks `new`'s pages (touches them too)
    assert sharing.cache.num_evictable_pages == 2
    assert used(sharing) == [5, 5]  # 4 cached + row 2's own third page
    sharing.make_room([8, 8])  # 3 free + 2 evictable can never make 8: the cache is kept
    assert sharing.cache.num_cached_tokens == 16
    sharing.make_room([5, 5])  # evicts every unlocked page; the locked ones stay
    assert sharing.cache.num_cached_tokens == 8
    assert sharing.lookup(new).num_tokens == 8 and sharing.lookup(old).num_tokens == 0
    sharing.release(2, None)
    assert sharing.flush() == 2
    assert used(sharing) == [0, 0]
    assert sharing.cache.num_evicted_pages == 4


def test_eviction_takes_the_least_recently_used_leaf_first():
    sharing = PrefixSharing(tables(num_pages=16), align_tokens=PS)
    prompts = [seq(100 * i, 9) for i in range(3)]
    for row, prompt in enumerate(prompts):
        run_request(sharing, row, prompt, 9)
        sharing.release(row, prompt)
    run_request(sharing, 3, prompts[0], 9)  # prompts[0] used again: now the most recent
    sharing.release(3, prompts[0])
    sharing.cache.evict(2)  # one whole prompt's two pages (a leaf, then its parent)
    assert [sharing.lookup(p).num_tokens for p in prompts] == [8, 0, 8]


def test_duplicate_pages_are_freed_and_the_tree_keeps_one_copy():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    prompt = seq(7, 9)
    run_request(sharing, 0, prompt, 10, share=False)
    run_request(sharing, 1, prompt, 10, share=False)  # admitted before row 0 shared anything: no hit
    assert sharing.cached_tokens(1) == 0
    sharing.release(0, prompt + [1])
    sharing.release(1, prompt + [1])  # its two full pages duplicate row 0's: freed
    assert sharing.cache.num_cached_tokens == 8
    assert used(sharing) == [2, 2]


def test_prompt_shared_at_prefill_end_serves_concurrent_requests():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    system = seq(500, 12)
    run_request(sharing, 0, system + [1, 2], 20)  # shares 3 pages, keeps decoding
    assert [t.num_borrowed(0) for t in sharing.tables] == [3, 3]
    assert sharing.cache.num_evictable_pages == 0  # lent back to row 0: locked
    assert run_request(sharing, 1, system + [3, 4, 5], 18) == 12
    sharing.release(0, system + [1, 2] + seq(900, 6))  # 20 tokens: pages 3 and 4 donated too
    sharing.release(1, system + [3, 4, 5] + seq(950, 3))  # page 3 differs from row 0's: donated beside it
    assert sharing.cache.num_cached_tokens == 4 * 5 + 4 * 1
    assert sharing.is_idle()
    sharing.flush()
    assert used(sharing) == [0, 0]


def test_share_stops_at_a_page_another_request_cached():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    prompt = seq(0, 13)
    run_request(sharing, 0, prompt, 13, share=False)
    run_request(sharing, 1, prompt, 13, share=False)
    sharing.share_prompt(0, prompt)
    sharing.share_prompt(1, prompt)  # the tree has these tokens under row 0's pages: row 1 keeps its own
    assert [t.num_borrowed(1) for t in sharing.tables] == [0, 0]
    sharing.release(1, prompt)
    sharing.release(0, prompt)
    assert used(sharing) == [3, 3]


def test_alignment_to_chunks():
    sharing = PrefixSharing(tables(), align_tokens=3 * PS)  # deterministic mode: chunked_prefill_size 12
    prompt = seq(0, 30)
    run_request(sharing, 0, prompt, 30)
    sharing.release(0, prompt)
    assert sharing.cache.num_cached_tokens == 28
    assert sharing.lookup(prompt).num_tokens == 24  # 7 pages cached, 6 usable: a multiple of 12
    assert sharing.lookup(prompt[:20] + [0] * 5).num_tokens == 12


def test_unlock_of_an_unlocked_node_is_an_error():
    cache = PrefixCache(PS, 1, lambda pool, pages: None)
    cache.insert(seq(0, 4), [[3]], PrefixMatch((), PS))
    match = cache.match(seq(0, 4), 4)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(match)


def test_adopt_refuses_a_row_that_holds_pages():
    table = tables(pools=1)[0]
    table.ensure(0, 5)
    with pytest.raises(RuntimeError, match="already holds pages"):
        table.adopt(0, [9])


def test_pools_of_different_page_sizes_are_refused():
    mixed = [RequestTokenTable(PagedAllocator(64, 4), 2, 64, "cpu"), RequestTokenTable(PagedAllocator(64, 8), 2, 64,
                                                                                       "cpu")]
    with pytest.raises(ValueError, match="one page size"):
        PrefixSharing(mixed, align_tokens=4)


def test_version_moves_when_the_tree_gains_or_loses_pages_only():
    sharing = PrefixSharing(tables(), align_tokens=PS)
    cache = sharing.cache
    prompt = seq(0, 9)
    run_request(sharing, 0, prompt, 9, share=False)
    assert cache.version == 0
    sharing.share_prompt(0, prompt)  # 2 pages join
    v = cache.version
    assert v > 0
    run_request(sharing, 1, prompt, 9, share=False)  # a lookup and a lock: no change
    sharing.release(1, None)
    assert cache.version == v
    sharing.release(0, prompt)  # nothing new to donate (its third page is partial)
    assert cache.version == v
    sharing.flush()
    assert cache.version > v


def test_admission_looks_a_waiting_prompt_up_again_only_after_the_cache_changed():
    from decode_server.engine.request import Request
    from decode_server.engine.sampling_params import SamplingParams
    from decode_server.engine.scheduler import Scheduler

    class Kv:
        prefix = object()
        page_size = PS
        prefix_cache_version = 0
        lookups = 0

        def cached_prefix_tokens(self, prompt_ids):
            self.lookups += 1
            return 8

    kv = Kv()
    scheduler = Scheduler(kv, max_running_requests=2, chunked_prefill_size=64)  # type: ignore[arg-type]
    req = Request("r", seq(0, 20), SamplingParams(max_tokens=2), arrival=0)
    assert [scheduler._cached_prefix_tokens(req) for _ in range(3)] == [8, 8, 8] and kv.lookups == 1
    kv.prefix_cache_version = 1
    assert scheduler._cached_prefix_tokens(req) == 8 and kv.lookups == 2
