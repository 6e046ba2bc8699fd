"""Which cached page is evicted next, by policy: the queue order stated in kvcache/pool.py,
a request's tail before its head, and the admitted batches that age the resident set."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, PagePool, block_hashes
from kvcache.pool import KEEP_HOT_PERIOD
from tests.kvcache.helpers import make_spec

SETS_PREFIX_CACHING = True
B = 4

# One release call: per page, whether it served a hit before its release.
batches_strategy = st.lists(st.lists(st.booleans(), min_size=1, max_size=4), min_size=1,
                            max_size=KEEP_HOT_PERIOD - 1)


def expected_order(batches: list[list[tuple[int, bool]]], eviction: str) -> list[int]:
    """The docstring's queue: cold batches at the front, newest first, each in release order;
    then hot pages by release (keep-hot). LRU: every page by release."""
    if eviction == "lru":
        return [page for batch in batches for page, _ in batch]
    cold_front = [page for batch in reversed(batches) for page, is_hot in batch if not is_hot]
    return cold_front + [page for batch in batches for page, is_hot in batch if is_hot]


@settings(max_examples=60, deadline=None)
@given(hot_flags=batches_strategy, eviction=st.sampled_from(["lru", "keep-hot"]), data=st.data())
def test_pages_are_evicted_in_the_stated_order(hot_flags, eviction, data):
    """Fewer than KEEP_HOT_PERIOD cold batches: under keep-hot every never-hit page is evicted
    before any hot one; a batch keeps its release order (the manager releases tail first)."""
    pool = PagePool(sum(len(flags) for flags in hot_flags), eviction)
    batches = []
    for number, flags in enumerate(hot_flags):
        pages = pool.take(len(flags))
        for ordinal, page in enumerate(pages):
            pool.cache(page, f"{number}/{ordinal}".encode())
        hits = [page for page, is_hot in zip(pages, flags) if is_hot]
        for page in hits:
            pool.pin(page)
        pool.release(hits)  # the hit's binding ends; the page is still owned, nothing becomes evictable
        order = data.draw(st.permutations(range(len(pages))))
        batch = [(pages[i], flags[i]) for i in order]
        pool.release(page for page, _ in batch)
        batches.append(batch)
        pool.check({})
    assert all(pool.is_hot(page) == is_hot for batch in batches for page, is_hot in batch)
    evicted = [pool.take(1)[0] for _ in range(pool.num_pages)]
    assert evicted == expected_order(batches, eviction)
    assert pool.num_cached == 0 and not any(pool.is_hot(page) for page in range(pool.num_pages))


def run_prefix(manager: KVCacheManager, request_id: str, prefix_tokens: list[int]) -> list[int]:
    """A request of ``prefix_tokens`` plus one token (a partial block, never cached); returns the ordinals it hit."""
    tokens = [*prefix_tokens, 10**6]
    hashes = block_hashes(tokens, B)
    manager.allocate(request_id, len(tokens), num_computed_tokens=len(tokens), block_hashes=hashes)
    hits = manager.get_cached_ordinals(request_id, "full")
    manager.cache_blocks(request_id, hashes, len(tokens))
    manager.free(request_id)
    manager.check_integrity()
    return hits


@pytest.mark.parametrize("eviction", ["lru", "keep-hot"])
@settings(max_examples=30, deadline=None)
@given(num_blocks=st.integers(2, 6), data=st.data())
def test_partial_eviction_takes_the_tail_and_a_shorter_prefix_still_hits(eviction, num_blocks, data):
    """A cold prefix of b blocks loses its last e blocks to a request needing e more pages;
    blocks [0, b - e) keep their pages and names, and a request of that head hits them all."""
    num_evicted = data.draw(st.integers(1, num_blocks - 1))
    manager = KVCacheManager(make_spec(None, B), num_blocks + 1, allocate_storage=False,
                             enable_prefix_caching=True, eviction=eviction)
    prefix = list(range(num_blocks * B))
    names = block_hashes(prefix, B)
    manager.allocate("a", len(prefix) + 1, num_computed_tokens=len(prefix) + 1, block_hashes=names)
    pages = manager.get_block_ordinals("a", "full")[:num_blocks]
    manager.cache_blocks("a", names, len(prefix) + 1)
    manager.free("a")
    run_prefix(manager, "other", [500 + t for t in range(num_evicted * B)])  # takes 1 free + e evicted pages
    pool, kept = manager.pools["full"], num_blocks - num_evicted
    assert [pool.cached_page(name) for name in names] == pages[:kept] + [None] * num_evicted
    assert run_prefix(manager, "head", prefix[:kept * B]) == list(range(kept))
    assert [pool.hash_of(page) for page in pages[:kept]] == names[:kept]


@pytest.mark.parametrize("old_is_hot", [False, True])
def test_admitted_batches_age_out_an_old_prefix(old_is_hot):
    """Room for 2 prefixes of 2 blocks. An old prefix O, then a stream of new prefixes S1, S2, ...
    each seen once: each S evicts the one before it, and O stays; the KEEP_HOT_PERIOD-th cold batch
    (S_{K-1}, O's being the first) is admitted to the recent end, so S_K evicts O. Under LRU S2 does."""
    num_blocks = 2
    for eviction, survives in (("keep-hot", KEEP_HOT_PERIOD - 1), ("lru", 1)):
        manager = KVCacheManager(make_spec(None, B), 2 * num_blocks + 1, allocate_storage=False,
                                 enable_prefix_caching=True, eviction=eviction)
        old = list(range(num_blocks * B))
        run_prefix(manager, "old", old)
        if old_is_hot:
            assert run_prefix(manager, "old-again", old) == list(range(num_blocks))
        old_names = block_hashes(old, B)
        for number in range(1, survives + 2):
            run_prefix(manager, f"s{number}", [1000 * number + t for t in range(num_blocks * B)])
            is_cached = [name in manager.cached_block_hashes("full") for name in old_names]
            assert is_cached == [number <= survives] * num_blocks, (eviction, number)
        if eviction == "keep-hot":  # the admitted S_{K-1} is now resident and hits
            admitted = [1000 * survives + t for t in range(num_blocks * B)]
            assert run_prefix(manager, "s-again", admitted) == list(range(num_blocks))
