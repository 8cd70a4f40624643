"""Prefix cache: a radix tree over page-sized blocks of token ids whose KV pages outlive their request.

Why pages: the pools hand out rows a page at a time (`kv_alloc.PagedAllocator`), and a page is the unit a request
table can map, so a cached prefix is a list of whole pages that a new request maps in front of its own pages
without copying a byte. Only full pages are cached; a request always computes at least its prompt's last token
(its logits are needed), and it writes only into its own pages, so a shared page is never written again.

Each node is one page of `page_size` tokens, keyed under its parent by those tokens (a trie of pages: the key of a
node is the whole prefix up to it, so two requests share a node only if every earlier token matches too). A node
holds one page id per pool (`num_pools`: one for the dense cache, whose MLA rows and indexer keys share slots;
two for HiSparse: the host pool and the GPU indexer-key pool, allocated in step).

Ownership: a page in the tree belongs to the tree. A request that reuses a prefix *locks* the path (a reference
count on every node from the root down), maps its pages, and unlocks it when it ends; only unlocked leaves can be
evicted, least recently used first, which frees their pages into the allocators. When a request ends, its full
pages that the tree lacks are *donated* (ownership moves, nothing is copied); a page whose tokens the tree already
holds (another request computed the same prefix meanwhile) is freed by the caller.

Everything here is host-side bookkeeping over integers: no tensors, no device.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

PageKey = tuple[int, ...]


@dataclass(eq=False)
class PrefixNode:
    """One cached page: its tokens (the key under the parent), a page id per pool, and who uses it."""

    key: PageKey
    pages: tuple[int, ...]
    parent: PrefixNode | None
    children: dict[PageKey, PrefixNode] = field(default_factory=dict)
    lock_ref: int = 0  # requests whose mapped prefix runs through this node


@dataclass(frozen=True)
class PrefixMatch:
    """The cached pages that start a token sequence: `nodes[i]` holds tokens [i·page, (i+1)·page)."""

    nodes: tuple[PrefixNode, ...]
    page_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.nodes) * self.page_size

    def pages(self, pool: int) -> list[int]:
        return [node.pages[pool] for node in self.nodes]


class PrefixCache:
    """The tree, its LRU of evictable leaves, and the counters the metrics report.

    `free_pages(pool, pages)` gives evicted pages back to pool `pool`'s allocator."""

    def __init__(self, page_size: int, num_pools: int, free_pages: Callable[[int, list[int]], None]) -> None:
        if page_size <= 0 or num_pools <= 0:
            raise ValueError(f"page_size ({page_size}) and num_pools ({num_pools}) must be positive")
        self.page_size = page_size
        self.num_pools = num_pools
        self._free_pages = free_pages
        self.root = PrefixNode(key=(), pages=(), parent=None)
        # Unlocked leaves, least recently used first: exactly the nodes that eviction may take next.
        self._evictable: OrderedDict[PrefixNode, None] = OrderedDict()
        self.num_nodes = 0
        self._num_locked = 0  # nodes with lock_ref > 0
        # Bumped whenever a node is added or evicted: a match made at the same version is still the match (callers
        # may keep one per waiting request instead of walking the tree again at every scheduling pass).
        self.version = 0
        # Counters (monotonic): prompt tokens looked up at admission and how many of them were found cached.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_pages = 0

    # -- lookup --
    def match(self, token_ids: Sequence[int], max_tokens: int) -> PrefixMatch:
        """The longest cached prefix of `token_ids` of at most `max_tokens` tokens, in whole pages (no lock, no
        counter: admission may look before it decides)."""
        ps = self.page_size
        nodes: list[PrefixNode] = []
        node = self.root
        limit = min(max_tokens, len(token_ids)) // ps
        for i in range(limit):
            child = node.children.get(tuple(token_ids[i * ps:(i + 1) * ps]))
            if child is None:
                break
            nodes.append(child)
            node = child
        return PrefixMatch(tuple(nodes), ps)

    def count_lookup(self, num_queried: int, num_hit: int) -> None:
        self.num_queried_tokens += num_queried
        self.num_hit_tokens += num_hit

    # -- use by requests --
    def lock(self, match: PrefixMatch) -> None:
        """A request maps these pages: none of them may be evicted until `unlock`."""
        for node in match.nodes:
            if node.lock_ref == 0:
                self._evictable.pop(node, None)
                self._num_locked += 1
            node.lock_ref += 1

    def unlock(self, match: PrefixMatch) -> None:
        """The request no longer maps them; leaves that nobody locks become evictable, as the most recently
        used (a request ending is the last use of its prefix)."""
        for node in reversed(match.nodes):
            if node.lock_ref <= 0:
                raise RuntimeError("prefix cache: unlock of a node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked -= 1
                if not node.children:
                    self._evictable[node] = None

    def insert(self, token_ids: Sequence[int], pages: Sequence[Sequence[int]], start: PrefixMatch,
               stop_at_existing: bool = False) -> list[bool]:
        """Donate the full pages of `token_ids` past `start` (the request's own locked prefix, whose pages are
        the tree's already). `pages[pool][i]` is the request's page i in that pool. Returns, per page index
        from `start.num_tokens // page_size` on, whether the tree took it (False: the tree holds those tokens
        already, under another page, which the caller must free). `stop_at_existing`: stop before the first
        page the tree holds already (the taken pages then continue `start` without a gap)."""
        ps = self.page_size
        node = start.nodes[-1] if start.nodes else self.root
        taken: list[bool] = []
        for i in range(len(start.nodes), len(token_ids) // ps):
            key = tuple(token_ids[i * ps:(i + 1) * ps])
            child = node.children.get(key)
            if child is None:
                if not node.children and node is not self.root:
                    self._evictable.pop(node, None)  # it gains a child: no longer a leaf
                child = PrefixNode(key=key, pages=tuple(p[i] for p in pages), parent=node)
                node.children[key] = child
                self._evictable[child] = None
                self.num_nodes += 1
                self.version += 1
                taken.append(True)
            else:
                if stop_at_existing:
                    break
                if child.lock_ref == 0 and not child.children:
                    self._evictable.move_to_end(child)  # touched: most recently used
                taken.append(False)
            node = child
        return taken

    # -- eviction --
    @property
    def num_evictable_pages(self) -> int:
        """Pages eviction could free now: every unlocked node (a locked node's ancestors are locked too, so the
        unlocked ones form subtrees that eviction frees leaf first)."""
        return self.num_nodes - self._num_locked

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages (per pool) from unlocked leaves, least recently used first; a parent left
        without children becomes a leaf and may follow. Returns how many pages were freed."""
        freed: list[PrefixNode] = []
        while len(freed) < num_pages and self._evictable:
            node, _ = self._evictable.popitem(last=False)
            parent = node.parent
            assert parent is not None and node.lock_ref == 0 and not node.children
            del parent.children[node.key]
            self.num_nodes -= 1
            freed.append(node)
            if parent is not self.root and parent.lock_ref == 0 and not parent.children:
                self._evictable[parent] = None
                self._evictable.move_to_end(parent, last=False)  # its last use is no later than its child's
        for pool in range(self.num_pools):
            if freed:
                self._free_pages(pool, [node.pages[pool] for node in freed])
        self.num_evicted_pages += len(freed)
        if freed:
            self.version += 1
        return len(freed)

    def flush(self) -> int:
        """Evict every unlocked node (SGLang's /flush_cache); locked prefixes stay. Returns the pages freed."""
        return self.evict(self.num_nodes)

    @property
    def num_cached_tokens(self) -> int:
        return self.num_nodes * self.page_size
