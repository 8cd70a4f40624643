"""Paged slot allocation and per-request token→slot tables.

One mechanism serves every pool that hands out rows per token: the dense device KV cache, the GPU indexer-key
cache, the HiSparse host pool and its prefill staging area. Allocation is by pages so that a request's table
grows a page at a time; slot ids are `page * page_size + offset`.
"""

from __future__ import annotations

import torch


class OutOfSlotsError(RuntimeError):
    """The pool has fewer free pages than asked for (callers check `can_allocate` first)."""


class PagedAllocator:
    """Free list of pages over `num_slots` rows. Device-agnostic: it hands out integers."""

    def __init__(self, num_slots: int, page_size: int, name: str = "pool") -> None:
        if num_slots <= 0 or page_size <= 0:
            raise ValueError(f"{name}: num_slots ({num_slots}) and page_size ({page_size}) must be positive")
        self.name = name
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        if self.num_pages == 0:
            raise ValueError(f"{name}: {num_slots} slots is less than one page of {page_size}")
        # Pop from the end: lowest page ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(self.num_pages - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise OutOfSlotsError(f"{self.name}: asked for {num_pages} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(num_pages)]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))
        if len(self._free) > self.num_pages:
            raise RuntimeError(f"{self.name}: double free (free list larger than the pool)")


class RequestTokenTable:
    """Token position → slot id for each request row, backed by pages of one `PagedAllocator`.

    The table tensor `[max_requests, max_context]` (int32, −1 = unmapped) lives on `device`, so kernels can
    gather physical rows without a host round trip; the page lists stay on the CPU.

    A row's first pages may be *borrowed* (`adopt`: a cached prefix's pages, owned by the prefix cache): they are
    mapped like the row's own but never freed by it.
    """

    def __init__(
        self, allocator: PagedAllocator, max_requests: int, max_context: int, device: torch.device | str
    ) -> None:
        self.allocator = allocator
        self.max_context = max_context
        self.table = torch.full((max_requests, max_context), -1, dtype=torch.int32, device=device)
        self._pages: dict[int, list[int]] = {}
        self._borrowed: dict[int, int] = {}  # row → how many of its first pages it does not own

    def capacity(self, req_row: int) -> int:
        return len(self._pages.get(req_row, ())) * self.allocator.page_size

    def pages_needed(self, req_row: int, num_tokens: int) -> int:
        return max(0, self.allocator.pages_for(num_tokens) - len(self._pages.get(req_row, ())))

    def ensure(self, req_row: int, num_tokens: int) -> None:
        """Make positions [0, num_tokens) of `req_row` mapped, allocating pages as needed."""
        if num_tokens > self.max_context:
            raise OutOfSlotsError(f"{num_tokens} tokens exceed the table's max_context {self.max_context}")
        need = self.pages_needed(req_row, num_tokens)
        if need == 0:
            return
        self._map(req_row, self.allocator.allocate(need))

    def adopt(self, req_row: int, pages: list[int]) -> None:
        """Map `pages` (owned elsewhere: a cached prefix) as the first pages of the empty row `req_row`."""
        if self._pages.get(req_row):
            raise RuntimeError(f"{self.allocator.name}: row {req_row} already holds pages; a prefix goes first")
        if pages:
            self._map(req_row, pages)
            self._borrowed[req_row] = len(pages)

    def num_borrowed(self, req_row: int) -> int:
        return self._borrowed.get(req_row, 0)

    def pages_of(self, req_row: int) -> list[int]:
        return list(self._pages.get(req_row, ()))

    def lend_head(self, req_row: int, num_pages: int) -> None:
        """The row's first `num_pages` pages now belong to someone else (its own ones were given to the prefix
        cache, which lends them back): it will not free them."""
        if not self.num_borrowed(req_row) <= num_pages <= len(self._pages.get(req_row, ())):
            raise RuntimeError(f"{self.allocator.name}: row {req_row} cannot lend {num_pages} pages")
        self._borrowed[req_row] = num_pages

    def _map(self, req_row: int, pages: list[int]) -> None:
        owned = self._pages.setdefault(req_row, [])
        ps = self.allocator.page_size
        start_page = len(owned)
        owned.extend(pages)
        offsets = torch.arange(ps, dtype=torch.int32)
        slots = (torch.tensor(pages, dtype=torch.int32).unsqueeze(1) * ps + offsets).flatten()
        start = start_page * ps
        end = min(start + slots.numel(), self.max_context)
        # Asynchronous copy (pageable source: CUDA stages it before returning), so a decode step that grows a
        # request by a page does not wait for the GPU.
        self.table[req_row, start:end] = slots[: end - start].to(self.table.device, non_blocking=True)

    def release(self, req_row: int) -> None:
        """Return every page `req_row` owns (not the borrowed ones) and unmap its row."""
        pages, borrowed = self.detach(req_row)
        if pages[borrowed:]:
            self.allocator.free(pages[borrowed:])

    def detach(self, req_row: int) -> tuple[list[int], int]:
        """Unmap `req_row` and return its pages (borrowed ones first) and how many are borrowed, freeing none: the
        caller decides which of its own pages the prefix cache keeps and which go back to the allocator."""
        pages = self._pages.pop(req_row, [])
        borrowed = self._borrowed.pop(req_row, 0)
        if pages:
            self.table[req_row].fill_(-1)
        return pages, borrowed

    def slots(self, req_row: int, num_tokens: int) -> torch.Tensor:
        return self.table[req_row, :num_tokens]

    def runs(self, req_row: int, start: int, end: int) -> list[tuple[int, int]]:
        """Positions [start, end) of `req_row` as runs of consecutive slots: [(first slot, length)], from the
        page lists on the CPU (no device read). Pages handed out together are usually consecutive, so a
        request's rows are a few runs that bulk copies can move at once."""
        pages = self._pages.get(req_row, [])
        ps = self.allocator.page_size
        runs: list[tuple[int, int]] = []
        pos = start
        while pos < end:
            page_index, offset = divmod(pos, ps)
            length = min(ps - offset, end - pos)
            slot = pages[page_index] * ps + offset
            if runs and runs[-1][0] + runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1] + length)
            else:
                runs.append((slot, length))
            pos += length
        return runs

    @property
    def num_requests(self) -> int:
        return len(self._pages)
