"""Pressure: random interleavings of allocate (on a prefix hit) / compute / cache_blocks /
append / draft scratch / release_stale / rewind / free over small pools whose requests
share prefixes. After every operation: integrity, no fresh page taken from an owner,
check-then-do answers that match what the operation does, and every live request still
reads its own positions and tokens (a shared page overwritten or evicted under an owner
would show up there)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, block_hashes
from tests.kvcache.helpers import make_spec
from tests.kvcache.prefix_helpers import fill_storage, read_problems, token_tag, write_tokens

SETS_PREFIX_CACHING = True

# Weights: compute, cache and free often enough that pools fill with cached pages and evict.
OPS = {"allocate": 3, "compute": 3, "cache": 3, "append": 1, "draft": 1, "stale": 1, "rewind": 1, "free": 2}


class Model:
    """The test's own record of each live request: its tokens and how many are computed."""

    def __init__(self, manager: KVCacheManager, rng: random.Random, draft_len: int) -> None:
        self.manager, self.rng, self.D = manager, rng, draft_len
        self.base = [rng.randrange(20) for _ in range(40)]
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.named: dict[bytes, tuple[int, list[int]]] = {}  # block name -> (ordinal, tokens up to its end)

    def hashes(self, tokens: list[int]) -> list[bytes]:
        B = self.manager.spec.tokens_per_block
        names = block_hashes(tokens, B)
        for i, name in enumerate(names):
            self.named[name] = (i, tokens[:(i + 1) * B])
        return names

    def owned(self) -> dict[str, set[int]]:
        return {g.name: {p for rid in self.tokens for p in self.manager.get_block_ordinals(rid, g.name) if p >= 0}
                for g in self.manager.spec.groups}

    def allocate(self, rid: str) -> None:
        m = self.manager
        rng = self.rng
        tokens = self.base[:rng.randrange(0, 20)] + [rng.randrange(20) for _ in range(rng.randrange(1, 6))]
        hashes = self.hashes(tokens)
        h = m.find_cached_prefix(hashes, len(tokens))
        kwargs = {"num_computed_tokens": h, "draft_len": self.D, "block_hashes": hashes}
        if not m.can_allocate(len(tokens), **kwargs):
            with pytest.raises(MemoryError):
                m.allocate(rid, len(tokens), **kwargs)
            return
        owned, free_before = self.owned(), {g: m.num_free_pages(g) for g in m.pools}
        evictable = {g: {p for p in range(pool.num_pages) if pool.is_evictable(p)} for g, pool in m.pools.items()}
        m.allocate(rid, len(tokens), **kwargs)
        for group, pool in m.pools.items():
            table, hits = m.get_block_ordinals(rid, group), m.get_cached_ordinals(rid, group)
            fresh = {p for i, p in enumerate(table) if p >= 0 and i not in hits}
            assert not fresh & owned[group], f"{group}: a fresh page was taken from an owner"
            assert all(pool.hash_of(table[i]) == hashes[i] for i in hits)
            taken = len(fresh) + sum(table[i] in evictable[group] for i in hits)
            assert free_before[group] - m.num_free_pages(group) == taken  # what can_allocate counted
        self.tokens[rid], self.computed[rid] = tokens, h

    def step(self, op: str, rid: str) -> None:
        m, rng = self.manager, self.rng
        if op == "allocate":
            if rid not in self.tokens:
                self.allocate(rid)
            return
        if rid not in self.tokens:
            return
        tokens, computed = self.tokens[rid], self.computed[rid]
        if op == "compute":
            stop = min(len(tokens), computed + rng.randrange(1, 6))
            write_tokens(m, rid, tokens, computed, stop)
            self.computed[rid] = stop
        elif op == "cache":
            m.cache_blocks(rid, self.hashes(tokens), computed)
        elif op == "append":
            self.append(rid, rng.randrange(0, 4))
        elif op == "draft":                                  # a verify pass writes the scratch
            write_tokens(m, rid, tokens, len(tokens), len(tokens) + self.D, junk=True)
        elif op == "stale":
            m.release_stale(rid, computed)
        elif op == "rewind":
            self.rewind(rid, rng.randrange(0, len(tokens) + 1))
        elif op == "free":
            m.free(rid)
            del self.tokens[rid], self.computed[rid]

    def append(self, rid: str, k: int) -> None:
        m = self.manager
        if not m.can_append(rid, k):
            with pytest.raises(MemoryError):
                m.append(rid, k)
            return
        owned = self.owned()
        before = {g: set(m.get_block_ordinals(rid, g)) for g in m.pools}
        m.append(rid, k)
        for group in m.pools:
            new = set(m.get_block_ordinals(rid, group)) - before[group] - {-1}
            assert not new & owned[group], f"{group}: append took a page from an owner"
        self.tokens[rid] += [self.rng.randrange(20) for _ in range(k)]

    def rewind(self, rid: str, n: int) -> None:
        m = self.manager
        if not m.can_rewind(rid, n):
            tables = {g: m.get_block_ordinals(rid, g) for g in m.pools}
            with pytest.raises(ValueError):
                m.rewind(rid, n)
            assert tables == {g: m.get_block_ordinals(rid, g) for g in m.pools}
            return
        m.rewind(rid, n)
        del self.tokens[rid][n:]
        self.computed[rid] = min(self.computed[rid], n)

    def check(self) -> None:
        self.manager.check_integrity()
        for rid, tokens in self.tokens.items():
            computed = self.computed[rid]
            assert read_problems(self.manager, rid, tokens, computed, computed - 1) == []
        self.check_cached_contents()

    def check_cached_contents(self) -> None:
        """Every cached page, owned or evictable, holds exactly the positions and tokens its name says."""
        B = self.manager.spec.tokens_per_block
        for group, pool in self.manager.pools.items():
            for name in pool.cached_hashes():
                ordinal, tokens = self.named[name]
                page = self.manager.storage.page(group, pool.cached_page(name))
                want = torch.tensor([token_tag(ordinal * B + s, tokens[ordinal * B + s]) for s in range(B)])
                got = page[:, :, :, 0, 0]                  # [layers, K/V, slot]
                assert torch.equal(got, want.expand(got.shape)), f"{group}: cached block {ordinal} was overwritten"


@settings(max_examples=40, deadline=None)
@given(B=st.sampled_from([1, 2, 4]), W=st.integers(2, 12), D=st.integers(0, 3), seed=st.integers(0, 2**16),
       full_pages=st.integers(5, 14), window_pages=st.integers(4, 10))
def test_random_operations_keep_owned_pages_and_contents(B, W, D, seed, full_pages, window_pages):
    manager = KVCacheManager(make_spec(W, B), {"full": full_pages * 4 // B, "sliding": window_pages * 4 // B},
                             enable_prefix_caching=True)
    fill_storage(manager)
    rng = random.Random(seed)
    model = Model(manager, rng, D)
    for _ in range(120):
        model.step(rng.choices(list(OPS), list(OPS.values()))[0], rng.choice("abcd"))
        model.check()
    for rid in list(model.tokens):
        manager.free(rid)
    manager.check_integrity()
    for pool in manager.pools.values():
        assert all(pool.is_free(p) or pool.is_evictable(p) for p in range(pool.num_pages))
    assert manager.num_free_pages() == manager.num_total_pages()
