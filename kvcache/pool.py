"""A reference-counted pool of page ids for one layer group, with a cache of full blocks.

Every page is in exactly one state::

    state        ref_count   block hash   where
    free         0           none         the free heap (never used, or its content evicted)
    evictable    0           yes          the eviction queue (below); still findable by its hash
    owned        >= 1        maybe        bound by ``ref_count`` (request, ordinal) pairs

    take:     free ──────────────► owned       lowest ids first; then
              evictable ─(evict)─► owned       the queue's front first, hash dropped
    pin:      evictable / owned ─► owned       a cache hit binds the page once more
    release:  owned ─(last one)──► free        or evictable, when the page has a hash
    cache:    owned, no hash ────► owned, hash

``num_free`` counts free and evictable pages: both can be taken, so a
check-then-do (``count <= num_free``, then ``take(count)``) stays right.

Eviction order (``eviction``). The evictable pages form one queue, evicted
from its front. ``"lru"`` appends every page that becomes evictable at the
back. Under a cyclic working set larger than the cache (N prefixes visited
round robin, room for M < N) that hits 0 times: each prefix is evicted just
before it comes back. ``"keep-hot"`` inserts by whether the page is *hot*
(it served a cache hit, ``pin``, since it was cached)::

    front (evicted next)                                    back (most recent)
    [ cold batches, newest first | hot pages and admitted cold batches, LRU ]
      ^ a cold batch goes here         ^ a hot page, and every KEEP_HOT_PERIOD-th
                                         cold batch (bimodal: no randomness), go here

One ``release`` call is one batch. A cold batch keeps its own order at the
front, so a request released tail first still loses its tail before its head
(a shorter prefix hit survives). New blocks that are never hit evict each
other and leave the resident ones alone: the cyclic working set keeps M - 1
prefixes resident (M - 1, not M: the missing prefix's own pages take the
M-th slot) and hits them every cycle. Without the admitted batches the
resident set could never change (a new working set would only ever evict
itself); with them, each admitted batch pushes out the least recently used
resident one, so an old working set ages out within about
``KEEP_HOT_PERIOD`` cold batches per resident prefix. The price, stated
because it refines "every cycle": the pushed-out prefix misses once, so a
cycle holding or following an admission may hit one prefix fewer per admission;
the admitted one is hit from then on in its place.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, KeysView, Mapping

EVICTION_POLICIES = ("lru", "keep-hot")
KEEP_HOT_PERIOD = 32  # keep-hot: every 32nd cold batch goes to the back of the queue


class PagePool:
    """Pages of one group; hands out never-used pages first, the lowest ids first.

    Lowest-first keeps a request's pages adjacent where the pool allows, and
    adjacent pages coalesce into one transfer descriptor. Cached pages are
    taken only when no free page is left, so caching never costs capacity.
    """

    def __init__(self, num_pages: int, eviction: str = "lru") -> None:
        if num_pages < 1:
            raise ValueError(f"a pool needs at least one page, got {num_pages}")
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {list(EVICTION_POLICIES)}, got {eviction!r}")
        self.num_pages = num_pages
        self.eviction = eviction
        self._is_hot = [False] * num_pages
        self._num_cold_batches = 0
        self._free_heap = list(range(num_pages))
        self._is_free = [True] * num_pages
        self._ref_count = [0] * num_pages
        self._hash_of: list[bytes | None] = [None] * num_pages
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- queries ---------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Pages ``take`` can hand out: free plus evictable."""
        return len(self._free_heap) + len(self._evictable)

    @property
    def num_empty(self) -> int:
        """Free pages that hold no cached block: taking one evicts nothing."""
        return len(self._free_heap)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def is_free(self, page: int) -> bool:
        return self._is_free[page]

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def is_hot(self, page: int) -> bool:
        """Whether the cached page served a cache hit since it was cached."""
        return self._is_hot[page]

    def ref_count(self, page: int) -> int:
        return self._ref_count[page]

    def cached_page(self, block_hash: bytes) -> int | None:
        """The page holding the block named ``block_hash``, or None."""
        return self._page_of.get(block_hash)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of[page]

    def cached_hashes(self) -> KeysView[bytes]:
        """Names of every cached block, owned or evictable (a live view, no copy)."""
        return self._page_of.keys()

    # -- operations ------------------------------------------------------
    def take(self, count: int) -> list[int]:
        """Own ``count`` pages: free ones lowest ids first, then evict the least recently used."""
        if count > self.num_free:
            raise MemoryError(f"asked for {count} pages, {self.num_free} free")
        num_fresh = min(count, len(self._free_heap))
        pages = [heapq.heappop(self._free_heap) for _ in range(num_fresh)]
        for page in pages:
            self._is_free[page] = False
        pages += [self._evict_oldest() for _ in range(count - num_fresh)]
        for page in pages:
            self._ref_count[page] = 1
        return pages

    def pin(self, page: int) -> None:
        """Bind a cached page once more (a cache hit): it is no longer evictable."""
        if self._hash_of[page] is None:
            raise ValueError(f"page {page} holds no cached block; only cached pages are shared")
        self._evictable.pop(page, None)
        self._ref_count[page] += 1
        self._is_hot[page] = True

    def release(self, pages: Iterable[int]) -> None:
        """Drop one binding of each page; a page nobody binds becomes evictable if cached, else free.

        Evictable pages join the queue by ``eviction`` (module docstring); the
        cold ones of this call go in as one batch, in the order given.
        """
        cold: list[int] = []
        try:
            for page in pages:
                if self._unbind(page) and self._hash_of[page] is not None:
                    if self._is_hot[page] or self.eviction == "lru":
                        self._evictable[page] = None  # most recently used end
                    else:
                        cold.append(page)
        finally:
            self._queue_cold(cold)

    def _unbind(self, page: int) -> bool:
        """Drop one binding; True when nobody binds the page any more. An uncached one is freed."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside the pool (0..{self.num_pages - 1})")
        if self._ref_count[page] == 0:
            raise ValueError(f"page {page} is freed twice")
        self._ref_count[page] -= 1
        if self._ref_count[page]:
            return False
        if self._hash_of[page] is None:
            self._is_free[page] = True
            heapq.heappush(self._free_heap, page)
        return True

    def _queue_cold(self, cold: list[int]) -> None:
        """keep-hot: one batch of never-hit pages to the front, ``[cold[0], cold[1], ...]`` evicted
        in that order; every ``KEEP_HOT_PERIOD``-th batch to the back instead."""
        if not cold:
            return
        self._num_cold_batches += 1
        if self._num_cold_batches % KEEP_HOT_PERIOD == 0:
            self._evictable.update(dict.fromkeys(cold))  # admitted: most recently used end
            return
        for page in reversed(cold):
            self._evictable[page] = None
            self._evictable.move_to_end(page, last=False)

    def cache(self, page: int, block_hash: bytes) -> bool:
        """Name an owned page's full block; False if another page already holds that block.

        The first page to hold a block keeps the name; a second copy stays
        unnamed and is freed with its request.
        """
        if self._ref_count[page] == 0:
            raise ValueError(f"page {page} is not owned; only a written, bound page can be cached")
        held = self._hash_of[page]
        if held is not None:
            if held != block_hash:
                raise AssertionError(f"page {page} is cached as {held.hex()}, asked to cache {block_hash.hex()}")
            return False
        if block_hash in self._page_of:
            return False
        self._hash_of[page] = block_hash
        self._page_of[block_hash] = page
        return True

    def _evict_oldest(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        del self._page_of[self._hash_of[page]]
        self._hash_of[page] = None
        self._is_hot[page] = False
        return page

    # -- checks ----------------------------------------------------------
    def check(self, num_owners: Mapping[int, int]) -> None:
        """Raise AssertionError unless every page is free, evictable-cached, or owned by
        exactly ``ref_count`` bindings (``num_owners[page]``, absent = 0)."""
        for page in range(self.num_pages):
            owners, count, name = num_owners.get(page, 0), self._ref_count[page], self._hash_of[page]
            if owners != count:
                raise AssertionError(f"page {page}: ref_count {count} but {owners} bindings")
            states = [self._is_free[page], page in self._evictable, count > 0]
            if sum(states) != 1:
                raise AssertionError(f"page {page}: free/evictable/owned = {states}, expected exactly one")
            if name is not None and self._page_of.get(name) != page:
                raise AssertionError(f"page {page}: its hash {name.hex()} maps to {self._page_of.get(name)}")
            if (self._is_free[page] or page in self._evictable) and (name is None) != self._is_free[page]:
                raise AssertionError(f"page {page}: unowned, free={self._is_free[page]}, hash={name}")
            if self._is_hot[page] and name is None:
                raise AssertionError(f"page {page}: hot but holds no cached block")
        if len(self._page_of) != sum(name is not None for name in self._hash_of):
            raise AssertionError("a cached hash names a page that does not hold it")
        if sorted(self._free_heap) != [p for p in range(self.num_pages) if self._is_free[p]]:
            raise AssertionError("the free heap and the free flags disagree")
