"""The pool's keep policy (kvcache.pool, segmented LRU): a cached block that a request hit is
evicted only after every never-hit one, so hot blocks (a system prompt's, the slice blocks a
generation worker keeps) survive a cyclic working set that plain LRU would evict them under."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.pool import PagePool


def name(i: int) -> bytes:
    return i.to_bytes(16, "little")


def use(pool: PagePool, block: int) -> bool:
    """One request reads block ``block``: a hit pins its cached page, a miss computes it into a new
    page and caches it; then the request ends. Returns whether it hit."""
    page = pool.cached_page(name(block))
    is_hit = page is not None
    if is_hit:
        pool.pin(page)
    else:
        (page,) = pool.take(1)
        assert pool.cache(page, name(block))
    pool.release([page])
    pool.check({})
    assert pool.hash_of(page) == name(block) and pool.is_evictable(page)
    return is_hit


@settings(max_examples=40, deadline=None)
@given(num_pages=st.integers(4, 40), num_hot=st.integers(1, 3), extra=st.integers(1, 30),
       num_rounds=st.integers(2, 6))
def test_hot_blocks_survive_a_cyclic_working_set_larger_than_the_pool(num_pages, num_hot, extra, num_rounds):
    """Each round: the hot blocks 0..num_hot-1 are read, then a cycle of cold blocks, one more
    than fits beside them (num_pages - num_hot + extra, each read once a round). Between two reads
    of a hot block more than ``num_pages`` other blocks are read, so plain LRU evicts every hot
    block each round (and every cold one: hit rate 0). Here the hot blocks hit from round 2 on."""
    pool = PagePool(num_pages)
    num_cold = num_pages - num_hot + extra
    hot_hits, cold_hits = [], []
    for _ in range(num_rounds):
        hot_hits.append([use(pool, b) for b in range(num_hot)])
        cold_hits.append([use(pool, 1000 + c) for c in range(num_cold)])
    assert hot_hits[0] == [False] * num_hot
    assert all(hits == [True] * num_hot for hits in hot_hits[1:])
    assert {pool.cached_page(name(b)) is not None for b in range(num_hot)} == {True}
    assert num_hot + num_cold > num_pages  # what makes plain LRU miss every read


def test_evict_order_is_probation_oldest_first_then_protected():
    pool = PagePool(4)
    for block in range(4):
        use(pool, block)
    use(pool, 1)  # block 1 is hit: protected
    use(pool, 10)  # a miss takes a page: probation's oldest (block 0) goes
    assert [pool.cached_page(name(b)) is not None for b in (0, 1, 2, 3, 10)] == [False, True, True, True, True]
    use(pool, 11)
    use(pool, 12)
    use(pool, 13)  # probation now holds 11, 12, 13 after evicting 2, 3, 10; block 1 stays
    assert pool.cached_page(name(1)) is not None
    assert [pool.cached_page(name(b)) is not None for b in (2, 3, 10)] == [False, False, False]


def test_the_protected_lru_is_bounded_and_demotes_its_oldest():
    """max_protected = 3 of 4 pages: a fourth hit block demotes the oldest protected one (block 0)
    to probation's newest end, where it is evicted before the other protected blocks."""
    pool = PagePool(4)
    assert pool.max_protected == 3
    for block in range(4):
        use(pool, block)
    for block in range(4):
        assert use(pool, block)  # every block hit once: 0 demoted when 3 joins
    assert list(pool._protected) == [pool.cached_page(name(b)) for b in (1, 2, 3)]
    use(pool, 20)
    assert pool.cached_page(name(0)) is None
    assert all(pool.cached_page(name(b)) is not None for b in (1, 2, 3))
