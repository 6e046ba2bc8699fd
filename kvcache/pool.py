"""A pool of page ids for one layer group."""

from __future__ import annotations

import heapq


class PagePool:
    """Free page ids of one group; hands out the lowest ids first.

    Lowest-first keeps a request's pages adjacent where the pool allows, and
    adjacent pages coalesce into one transfer descriptor.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self._free_heap = list(range(num_pages))
        self._is_free = [True] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free_heap)

    def take(self, count: int) -> list[int]:
        """Remove ``count`` free pages from the pool, lowest ids first."""
        if count > self.num_free:
            raise MemoryError(f"asked for {count} pages, {self.num_free} free")
        pages = [heapq.heappop(self._free_heap) for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
        return pages

    def give_back(self, pages: list[int]) -> None:
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page {page} is outside the pool (0..{self.num_pages - 1})")
            if self._is_free[page]:
                raise ValueError(f"page {page} is freed twice")
            self._is_free[page] = True
            heapq.heappush(self._free_heap, page)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def free_pages(self) -> set[int]:
        return set(self._free_heap)
