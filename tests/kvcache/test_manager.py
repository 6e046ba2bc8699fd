"""Manager lifecycle: allocation by role, growth with draft scratch, window
release, rewind, free — positions checked through page contents."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import KVCacheManager, get_kv_capacity_tokens
from tests.kvcache.helpers import make_spec, needed_ordinals

TAG_JUNK = -1.0


def write_positions(manager, rid, start, stop, tag_of, skip_unbound=False):
    """Write a tag for positions [start, stop) into the page that holds each position."""
    B = manager.spec.tokens_per_block
    for group in manager.spec.groups:
        table = manager.get_block_ordinals(rid, group.name)
        for position in range(start, stop):
            page = table[position // B]
            if page < 0 and skip_unbound:
                continue
            assert page >= 0, f"{group.name}: position {position} has no page to write to"
            manager.storage.page(group.name, page)[:, :, position % B].fill_(tag_of(position))


def assert_window_readable(manager, rid, query_position):
    """Every key the query at ``query_position`` reads sits in its own page with its own tag."""
    B = manager.spec.tokens_per_block
    for group in manager.spec.groups:
        table = torch.tensor(manager.get_block_ordinals(rid, group.name))
        lowest = 0 if group.window is None else max(0, query_position - group.window + 1)
        positions = torch.arange(lowest, query_position)
        pages = table[positions // B]
        assert (pages >= 0).all(), f"{group.name}: a key in [{lowest}, {query_position}) is unbound"
        got = manager.storage.tensors[group.name][pages, 0, 0, positions % B, 0, 0]
        assert torch.equal(got, positions.float()), f"{group.name}: keys read {got.tolist()}"


def window_bound(W, B, D, E):
    return math.ceil((W + D + E) / B) + 1


@settings(max_examples=30, deadline=None)
@given(
    B=st.sampled_from([2, 4, 8, 16]), W=st.integers(2, 40), P=st.integers(1, 90),
    D=st.integers(0, 4), E=st.integers(0, 2), seed=st.integers(0, 2**16),
)
def test_long_decode_with_drafts_and_rewinds(B, W, P, D, E, seed):
    rng = random.Random(seed)
    steps = 40
    manager = KVCacheManager(make_spec(W, B), math.ceil((P + steps * (D + 1) + D + E) / B) + 2)
    start_free = manager.num_free_pages()
    manager.allocate("r", P, num_computed_tokens=P, draft_len=D, num_extra_kv_tokens=E)
    write_positions(manager, "r", 0, P, float, skip_unbound=True)  # the received prompt
    n = P
    for _ in range(steps):
        manager.append("r", 1)                                   # the pending token at position n
        manager.check_integrity()
        num_drafts = rng.randint(0, D)
        write_positions(manager, "r", n, n + 1 + num_drafts, lambda p: TAG_JUNK)  # verify pass writes scratch
        accepted = rng.randint(0, num_drafts)
        write_positions(manager, "r", n, n + 1 + accepted, float)  # the verified ones are real
        manager.append("r", accepted)
        n += 1 + accepted
        if rng.random() < 0.2 and accepted:                      # a stop string trims tokens back
            manager.rewind("r", n - accepted)
            n -= accepted
        manager.release_stale("r", n)
        manager.check_integrity()
        sliding = manager.get_block_ordinals("r", "sliding")
        full = manager.get_block_ordinals("r", "full")
        capacity = get_kv_capacity_tokens(n, D, E)
        assert len(sliding) == len(full) == math.ceil(capacity / B)
        assert all(page >= 0 for page in full)
        assert sum(page >= 0 for page in sliding) <= window_bound(W, B, D, E)
        assert [i for i, page in enumerate(sliding[: math.ceil(n / B)]) if page >= 0] == needed_or_tail(n, W, B)
        assert_window_readable(manager, "r", n)
    manager.free("r")
    manager.check_integrity()
    assert manager.num_free_pages() == start_free


def needed_or_tail(n, W, B):
    needed = needed_ordinals(n, W, B)
    return needed if needed else []


def test_memory_bound_gpt_oss_geometry():
    """W=128, B=32, P=8192, D=3: the window group binds at most 6 pages through a long decode."""
    manager = KVCacheManager(make_spec(128, 32), {"full": 300, "sliding": 8}, allocate_storage=False)
    manager.allocate("r", 8192, num_computed_tokens=8192, draft_len=3)
    n, most = 8192, 0
    for step in range(200):
        manager.append("r", 1)
        most = max(most, sum(p >= 0 for p in manager.get_block_ordinals("r", "sliding")))
        manager.append("r", step % 4)
        n += 1 + step % 4
        manager.release_stale("r", n)
        manager.check_integrity()
        assert len(manager.get_block_ordinals("r", "full")) == math.ceil((n + 3) / 32)
    assert most <= 6
    manager.free("r")
    assert manager.num_free_pages() == 308


def test_context_side_holds_prompt_plus_extra_without_drafts():
    manager = KVCacheManager(make_spec(16, 8), 16)
    manager.allocate("r", 30, num_extra_kv_tokens=2, include_drafts=False)
    for group in ("full", "sliding"):
        table = manager.get_block_ordinals("r", group)
        assert len(table) == 4 and all(page >= 0 for page in table)


def test_generation_side_binds_nothing_below_stale_end():
    manager = KVCacheManager(make_spec(16, 8), 16)
    manager.allocate("r", 30, num_computed_tokens=30, draft_len=3, num_extra_kv_tokens=2)
    sliding = manager.get_block_ordinals("r", "sliding")
    assert sliding[0] == -1 and all(page >= 0 for page in sliding[1:]) and len(sliding) == 5
    assert all(page >= 0 for page in manager.get_block_ordinals("r", "full"))


def test_check_then_do_when_full():
    manager = KVCacheManager(make_spec(None, 4), 4)
    assert manager.can_allocate(16) and not manager.can_allocate(17)
    manager.allocate("a", 12)
    assert not manager.can_allocate(8) and manager.can_allocate(4)
    with pytest.raises(MemoryError):
        manager.allocate("b", 8)
    assert manager.can_append("a", 4) and not manager.can_append("a", 5)
    with pytest.raises(MemoryError):
        manager.append("a", 5)
    assert not manager.try_append("a", 5)  # refused: nothing bound, the length unchanged
    manager.check_integrity()
    assert manager.get_block_ordinals("a", "full") == [0, 1, 2] and manager.num_tokens("a") == 12
    assert manager.try_append("a", 1) and manager.get_block_ordinals("a", "full") == [0, 1, 2, 3]
    assert manager.num_tokens("a") == 13 and manager.num_free_pages() == 0
    manager.check_integrity()
    manager.free("a")
    assert manager.num_free_pages() == 4


def test_rewind_past_released_window_is_refused():
    manager = KVCacheManager(make_spec(8, 4), 16)
    manager.allocate("r", 20, num_computed_tokens=20)
    manager.release_stale("r", 20)
    with pytest.raises(ValueError, match="released"):
        manager.rewind("r", 10)
    manager.rewind("r", 19)
    manager.check_integrity()


def test_duplicate_and_unknown_requests():
    manager = KVCacheManager(make_spec(None, 4), 8)
    manager.allocate("a", 4)
    with pytest.raises(ValueError):
        manager.allocate("a", 4)
    with pytest.raises(KeyError):
        manager.get_block_ordinals("zzz", "full")
    manager.free("zzz")  # no-op
    manager.free("a")
    manager.free("a")
    assert manager.num_free_pages() == 8


OPS = st.sampled_from(["alloc", "append", "free", "stale"])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), OPS, st.integers(0, 20)), max_size=40))
def test_random_operations_keep_every_page_owned_once(ops):
    manager = KVCacheManager(make_spec(6, 4), 12)
    for rid, op, k in ops:
        if op == "alloc" and not manager.has_request(rid) and manager.can_allocate(k + 1, draft_len=2):
            manager.allocate(rid, k + 1, draft_len=2)
        elif op == "append" and manager.has_request(rid) and manager.can_append(rid, k % 5):
            manager.append(rid, k % 5)
        elif op == "stale" and manager.has_request(rid):
            manager.release_stale(rid, min(k, manager.num_tokens(rid)))
        elif op == "free":
            manager.free(rid)
        manager.check_integrity()
    for rid in list(manager.request_ids):
        manager.free(rid)
    assert manager.num_free_pages() == 24
