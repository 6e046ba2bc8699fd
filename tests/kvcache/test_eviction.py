"""Eviction order through KVCacheManager: LRU against keep-hot under a cyclic working set.

The workload is a generation side's: prefix ``i`` is ``b`` full blocks of its own
tokens, followed by one token unique to the request (a partial block, never
cached), so each request binds ``b + 1`` pages and can hit all ``b`` prefix blocks::

    tokens   [ prefix i: b * B tokens  | q ]     q: one token of this request alone
    ordinal    0      1   ...   b - 1    b

The pool has ``M * b + 1`` pages: room for M whole prefixes plus the request's
own partial block. N > M prefixes are visited round robin, one request at a time.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, block_hashes
from kvcache.pool import KEEP_HOT_PERIOD
from tests.kvcache.helpers import make_spec

SETS_PREFIX_CACHING = True
B = 4


class CyclicRun:
    """Visits prefixes through a manager and records, per visit, which ordinals hit and on which pages."""

    def __init__(self, num_prefixes: int, num_resident: int, blocks_per_prefix: int, eviction: str) -> None:
        self.num_prefixes, self.blocks_per_prefix = num_prefixes, blocks_per_prefix
        self.manager = KVCacheManager(make_spec(None, B), num_resident * blocks_per_prefix + 1,
                                      allocate_storage=False, enable_prefix_caching=True, eviction=eviction)
        self.first_pages: dict[int, list[int]] = {}  # prefix -> the pages its blocks were first cached on
        self.num_requests = 0
        self.num_misses = 0

    def prefix_hashes(self, prefix: int) -> list[bytes]:
        return block_hashes(self.tokens(prefix)[:-1], B)

    def tokens(self, prefix: int) -> list[int]:
        return [1000 * prefix + t for t in range(self.blocks_per_prefix * B)] + [10**6 + self.num_requests]

    def visit(self, prefix: int) -> bool:
        """One request of ``prefix``; True on a whole-prefix hit, asserting it binds the first pages."""
        tokens, request_id = self.tokens(prefix), f"r{self.num_requests}"
        hashes = block_hashes(tokens, B)
        self.num_requests += 1
        self.manager.allocate(request_id, len(tokens), num_computed_tokens=len(tokens), block_hashes=hashes)
        hits, table = self.manager.get_cached_ordinals(request_id, "full"), self.manager.get_block_ordinals(
            request_id, "full")
        pool = self.manager.pools["full"]
        assert hits in ([], list(range(self.blocks_per_prefix))), f"prefix {prefix}: partial hit {hits}"
        if hits:
            assert table[:self.blocks_per_prefix] == self.first_pages[prefix]
            assert [pool.hash_of(page) for page in table[:self.blocks_per_prefix]] == hashes[:self.blocks_per_prefix]
        else:
            self.num_misses += 1
        self.manager.cache_blocks(request_id, hashes, len(tokens))
        if not hits:
            self.first_pages[prefix] = table[:self.blocks_per_prefix]
        self.manager.free(request_id)
        self.manager.check_integrity()
        return bool(hits)

    def cycle(self) -> list[int]:
        """One pass over every prefix; the prefixes that hit."""
        return [prefix for prefix in range(self.num_prefixes) if self.visit(prefix)]

    def is_resident(self, prefix: int) -> bool:
        cached = self.manager.cached_block_hashes("full")
        return all(name in cached for name in self.prefix_hashes(prefix))


@st.composite
def cyclic_shapes(draw, min_resident: int = 1):
    num_prefixes = draw(st.integers(min_resident + 1, 8))
    return num_prefixes, draw(st.integers(min_resident, num_prefixes - 1)), draw(st.integers(1, 3))


@settings(max_examples=40, deadline=None)
@given(shape=cyclic_shapes(), num_cycles=st.integers(2, 3))
def test_lru_never_hits_a_cycle_larger_than_the_cache(shape, num_cycles):
    """Each prefix is evicted, wholly, just before it comes back."""
    run = CyclicRun(*shape, eviction="lru")
    run.cycle()
    for _ in range(num_cycles - 1):
        assert run.cycle() == []


@settings(max_examples=40, deadline=None)
@given(shape=cyclic_shapes(), num_cycles=st.integers(2, 3))
def test_keep_hot_keeps_the_first_m_minus_1_prefixes_and_hits_them_every_cycle(shape, num_cycles):
    """Before any admitted batch (at most 8 + 2 * 8 < KEEP_HOT_PERIOD cold batches here): prefixes
    0..M-2 stay on the pages they were first cached on; each miss evicts the previous miss."""
    num_prefixes, num_resident, _ = shape
    run = CyclicRun(*shape, eviction="keep-hot")
    run.cycle()
    kept = list(range(num_resident - 1))
    assert [p for p in range(num_prefixes) if run.is_resident(p)] == [*kept, num_prefixes - 1]
    for _ in range(num_cycles - 1):
        assert run.cycle() == kept
        assert [p for p in range(num_prefixes) if run.is_resident(p)] == [*kept, num_prefixes - 1]
    assert all(run.manager.pools["full"].is_hot(page) for p in kept for page in run.first_pages[p])
    assert run.num_misses < KEEP_HOT_PERIOD


@settings(max_examples=15, deadline=None)
@given(shape=cyclic_shapes(min_resident=2), num_cycles=st.integers(20, 40))
def test_keep_hot_with_admitted_batches_loses_at_most_one_hit_per_admission(shape, num_cycles):
    """Every KEEP_HOT_PERIOD-th miss is admitted to the recent end and pushes out the least recently
    used resident prefix: that prefix misses once (in the admission's cycle or the next), so a cycle
    hits at least M - 1 prefixes less the admissions of it and the one before."""
    _, num_resident, _ = shape
    run = CyclicRun(*shape, eviction="keep-hot")
    run.cycle()
    admissions_before = 0  # at the start of the cycle before the current one (2 misses a cycle at least)
    num_hits = []
    for _ in range(num_cycles - 1):
        admissions_at_start = run.num_misses // KEEP_HOT_PERIOD
        num_hits.append(len(run.cycle()))
        admissions = run.num_misses // KEEP_HOT_PERIOD
        assert num_hits[-1] >= num_resident - 1 - (admissions - admissions_before)
        admissions_before = admissions_at_start
    assert run.num_misses >= KEEP_HOT_PERIOD  # at least one admission was made
    assert sum(num_hits) >= (num_cycles - 1) * (num_resident - 1) - run.num_misses // KEEP_HOT_PERIOD
