"""Prefix cache, case by case: the worked example of prefix.py, the window rule's
non-monotone hits, the generation side's allocate, rewinds, first-copy-wins, exact
check-then-do with pinned hits, and the cache switched off."""

import pytest

from kvcache import KVCacheManager, block_hashes, cached_prefix_length, plan_slice
from tests.kvcache.helpers import make_spec
from tests.kvcache.prefix_helpers import fill_storage, read_problems, run_request, write_tokens
from tests.kvcache.test_prefix_sweep import count_based_hit

SETS_PREFIX_CACHING = True

TOKENS = [(7 * i + 3) % 50 for i in range(64)]


def manager_with(window, B, pages, enabled=True):
    manager = KVCacheManager(make_spec(window, B), pages, enable_prefix_caching=enabled)
    fill_storage(manager)
    return manager


def test_worked_example_b8_w16():
    """Blocks 0..3 cached in both groups: h = 32 binds full 0..3 and window 2, 3 only."""
    manager = manager_with(16, 8, {"full": 12, "sliding": 12})
    run_request(manager, "A", TOKENS[:33], 33)            # A's window released blocks 0 and 1: evictable
    a_full, a_window = (manager.get_block_ordinals("A", g) for g in ("full", "sliding"))
    manager.free("A")
    hashes = block_hashes(TOKENS[:40], 8)
    assert all(h in manager.cached_block_hashes("sliding") for h in hashes[:4])
    assert manager.find_cached_prefix(hashes, 40) == 32
    manager.allocate("B", 40, num_computed_tokens=32, draft_len=3, num_extra_kv_tokens=2, block_hashes=hashes)
    full, window = (manager.get_block_ordinals("B", g) for g in ("full", "sliding"))
    assert full[:4] == a_full[:4] and window[:4] == [-1, -1, a_window[2], a_window[3]]
    assert manager.get_cached_ordinals("B", "full") == [0, 1, 2, 3]
    assert manager.get_cached_ordinals("B", "sliding") == [2, 3]
    write_tokens(manager, "B", TOKENS, 32, 40)
    assert read_problems(manager, "B", TOKENS, 32, 39) == []
    manager.check_integrity()


def test_hit_rule_on_plain_name_sets():
    """The rule a router applies to what it knows of a replica: names per group, no pages."""
    spec, hashes = make_spec(16, 8), block_hashes(TOKENS, 8)
    head = {"full": set(hashes[:4]), "sliding": set(hashes[:2])}
    tail = {"full": set(hashes[:4]), "sliding": set(hashes[2:4])}
    assert [cached_prefix_length(spec, tail, hashes, P) for P in (40, 33, 32, 2, 1)] == [32, 32, 0, 0, 0]
    assert [cached_prefix_length(spec, head, hashes, P) for P in (40, 33, 32, 17, 16)] == [16, 16, 16, 16, 8]


def lose_window_blocks(release_head_first: bool):
    """A caches blocks 0..3 of TOKENS; a filler then evicts two of A's window blocks: the
    head (0, 1) when A released it early, else the tail (2, 3) that A's free released first."""
    manager = manager_with(16, 8, {"full": 16, "sliding": 6})
    manager.allocate("A", 33)
    write_tokens(manager, "A", TOKENS, 0, 33)
    manager.cache_blocks("A", block_hashes(TOKENS[:33], 8), 33)
    if release_head_first:
        manager.release_stale("A", 33)
    manager.free("A")
    manager.allocate("F", 32)                             # 2 free pages, then 2 evictions
    write_tokens(manager, "F", [], 0, 32, junk=True)
    manager.free("F")
    return manager


def test_window_rule_is_not_monotone():
    manager = lose_window_blocks(release_head_first=True)
    hashes = block_hashes(TOKENS, 8)
    window = manager.cached_block_hashes("sliding")
    assert [h in window for h in hashes[:4]] == [False, False, True, True]
    assert manager.find_cached_prefix(hashes, 40) == 32   # window needs 2, 3
    assert manager.find_cached_prefix(hashes, 32) == 0    # 24 needs window 1, 2; 16 needs 0, 1; 8 needs 0
    h, problems = run_request(manager, "B", TOKENS[:40], 40)
    assert h == 32 and problems == []


def test_counting_matching_blocks_over_credits_a_stale_head():
    manager = lose_window_blocks(release_head_first=False)
    hashes = block_hashes(TOKENS, 8)
    window = manager.cached_block_hashes("sliding")
    assert [h in window for h in hashes[:4]] == [True, True, False, False]
    assert manager.find_cached_prefix(hashes, 40) == 16   # window needs 0, 1 only
    assert count_based_hit(manager, hashes, 40) == 32     # "2 cached, the window spans 2"
    assert run_request(manager, "B", TOKENS[:40], 40)[1] == []
    mutant = lose_window_blocks(release_head_first=False)  # B cached blocks 2, 3 again: start over
    _, problems = run_request(mutant, "M", TOKENS[:40], 40, hit_rule=count_based_hit)
    assert problems and all("sliding" in p for p in problems)


def test_generation_side_binds_cached_ordinals_and_skips_them_in_the_transfer():
    B, W, D, E = 4, 8, 3, 1
    turn1, turn2 = TOKENS[:19], TOKENS[:22]               # turn 2 = turn 1 (prompt 13 + 6 decoded) + 3 new
    gen = manager_with(W, B, 24)
    gen.allocate("t1", 13, num_computed_tokens=13, draft_len=D, num_extra_kv_tokens=E)
    write_tokens(gen, "t1", turn1, 0, 13, skip_unbound=True)  # what the pull of turn 1's slice delivered
    gen.cache_blocks("t1", block_hashes(turn1[:13], B), 13)
    gen.release_stale("t1", 13)
    for n in range(13, 19):
        gen.append("t1", 1)
        write_tokens(gen, "t1", turn1, n, n + 1)
        gen.cache_blocks("t1", block_hashes(turn1[:n + 1], B), n + 1)
        gen.release_stale("t1", n + 1)
    old = {g: gen.get_block_ordinals("t1", g) for g in ("full", "sliding")}
    gen.free("t1")

    ctx = manager_with(W, B, 24)
    run_request(ctx, "t2", turn2, 22)                     # the context side computes all of turn 2
    gen.allocate("t2", 22, num_computed_tokens=22, draft_len=D, num_extra_kv_tokens=E,
                 block_hashes=block_hashes(turn2, B))
    # Turn 1's full blocks are 0..3 (19 tokens); the window slice starts at stale_end(22) = (23 - 8) // 4 = 3.
    assert gen.get_cached_ordinals("t2", "full") == [0, 1, 2, 3]
    assert gen.get_cached_ordinals("t2", "sliding") == [3]
    assert gen.get_block_ordinals("t2", "full")[:4] == old["full"][:4]
    assert gen.get_block_ordinals("t2", "sliding")[:4] == [-1, -1, -1, old["sliding"][3]]
    for group in gen.spec.groups:
        dst = gen.get_block_ordinals("t2", group.name)
        cached = gen.get_cached_ordinals("t2", group.name)
        skip = [-1 if i in cached else page for i, page in enumerate(dst)]
        plan = plan_slice(ctx.get_block_ordinals("t2", group.name), skip, 22, group.window, B)
        assert not {i for i, _, _ in plan} & set(cached)
        for _, src, dst_page in plan:
            gen.storage.page(group.name, dst_page).copy_(ctx.storage.page(group.name, src))
    assert read_problems(gen, "t2", turn2, 22, 21) == []  # every key the first decode query reads
    hashes = block_hashes(turn2, B)
    gen.cache_blocks("t2", hashes, 22)                    # after the pull: block 4 (16..19) is new in both groups
    assert all(hashes[4] in gen.cached_block_hashes(g) for g in ("full", "sliding"))
    gen.check_integrity()


def test_generation_side_window_hits_by_ordinal():
    """Per ordinal, no prefix requirement: window blocks 5, 6 cached alone are bound."""
    B, W = 4, 8
    gen = manager_with(W, B, 24)
    run_request(gen, "t1", TOKENS[:29], 29)
    gen.free("t1")
    hashes = block_hashes(TOKENS[:31], B)
    gen.allocate("t2", 31, num_computed_tokens=31, block_hashes=hashes)
    # stale_end(31) = (32 - 8) // 4 = 6; cached full blocks of t1: 0..6 (29 tokens)
    assert gen.get_cached_ordinals("t2", "sliding") == [6]
    assert gen.get_cached_ordinals("t2", "full") == list(range(7))
    write_tokens(gen, "t2", TOKENS, 28, 31)               # ordinal 7: the part the transfer would bring
    assert read_problems(gen, "t2", TOKENS, 31, 30) == []


def test_rewind_never_cuts_into_a_cached_block():
    manager = manager_with(None, 4, 8)
    run_request(manager, "r", TOKENS[:10], 10)            # blocks 0 and 1 cached, block 2 partial
    assert not manager.can_rewind("r", 7)
    with pytest.raises(ValueError, match="cached"):
        manager.rewind("r", 7)
    assert manager.can_rewind("r", 8) and manager.can_rewind("r", 4)
    manager.rewind("r", 4)                                # block 1 unbound: still cached, evictable
    assert block_hashes(TOKENS, 4)[1] in manager.cached_block_hashes("full")
    manager.append("r", 5)
    other = [(t + 1) % 50 for t in TOKENS[4:9]]
    tokens = TOKENS[:4] + other
    write_tokens(manager, "r", tokens, 4, 9)
    assert read_problems(manager, "r", tokens, 8, 8) == []
    manager.free("r")
    h, problems = run_request(manager, "again", TOKENS[:12], 12)
    assert h == 8 and problems == []                      # block 1 kept its own tokens through the rewind
    manager.check_integrity()


def test_first_copy_keeps_the_name():
    manager = manager_with(None, 4, 8)
    hashes = block_hashes(TOKENS[:8], 4)
    for rid in ("a", "b"):                                # both miss: they compute the same blocks at once
        manager.allocate(rid, 8, block_hashes=hashes)
        write_tokens(manager, rid, TOKENS, 0, 8)
    assert manager.cache_blocks("a", hashes, 8) == 2
    assert manager.cache_blocks("b", hashes, 8) == 0
    a_pages, b_pages = manager.get_block_ordinals("a", "full"), manager.get_block_ordinals("b", "full")
    manager.free("a")
    manager.free("b")
    pool = manager.pools["full"]
    assert all(pool.is_evictable(p) for p in a_pages) and all(pool.is_free(p) for p in b_pages)
    assert manager.num_cached_blocks() == 2 and manager.num_free_pages() == 8
    assert manager.num_empty_pages() == 6                 # a's two pages still hold their blocks
    assert manager.num_empty_pages() == 8 - len(a_pages)
    manager.allocate("c", 28)                             # 7 pages: the 6 empty ones, then evict a's oldest
    assert manager.num_empty_pages() == 0 and manager.num_cached_blocks() == 1


def test_can_allocate_counts_fresh_pages_and_pinned_evictable_hits():
    manager = manager_with(None, 4, 6)
    hashes = block_hashes(TOKENS[:24], 4)
    run_request(manager, "a", TOKENS[:16], 16)            # 4 cached blocks, owned by a
    kwargs = {"num_computed_tokens": 12, "block_hashes": hashes}
    assert manager.can_allocate(16, **kwargs)             # hits 0..2 owned: 1 fresh of 2 free
    assert manager.can_allocate(20, **kwargs) and not manager.can_allocate(24, **kwargs)
    manager.free("a")                                     # hits become evictable: they now count
    assert manager.num_free_pages() == 6
    assert manager.can_allocate(24, **kwargs)             # 3 pinned + 3 fresh (2 free + evict block 3)
    assert not manager.can_allocate(28, **kwargs)
    with pytest.raises(MemoryError):
        manager.allocate("b", 28, **kwargs)
    manager.allocate("b", 24, **kwargs)
    assert manager.num_free_pages() == 0 and manager.get_cached_ordinals("b", "full") == [0, 1, 2]
    assert hashes[3] not in manager.cached_block_hashes("full")   # evicted for b's ordinal 3
    manager.check_integrity()


def test_switched_off_the_cache_names_nothing():
    manager = manager_with(16, 8, 12, enabled=False)
    h, problems = run_request(manager, "a", TOKENS[:33], 33)
    manager.free("a")
    hashes = block_hashes(TOKENS[:40], 8)
    assert h == 0 and problems == [] and manager.num_cached_blocks() == 0
    assert manager.find_cached_prefix(hashes, 40) == 0
    manager.allocate("b", 40, num_computed_tokens=40, block_hashes=hashes)
    assert manager.get_cached_ordinals("b", "full") == [] and manager.get_cached_ordinals("b", "sliding") == []
    assert manager.num_free_pages() == 24 - 5 - 2         # full 0..4, window 3..4 (stale_end(40) = 3): all fresh


def test_accepted_drafts_are_named_once_appended():
    """Drafts verified in the scratch [10, 13) are computed before append commits them."""
    manager = manager_with(None, 4, 8)
    hashes = block_hashes(TOKENS[:13], 4)
    manager.allocate("r", 10, draft_len=3)
    write_tokens(manager, "r", TOKENS, 0, 12)             # the prompt and two accepted drafts
    assert manager.cache_blocks("r", hashes, 12) == 2     # block 2 = 8..11 lies past the 10 held tokens
    assert hashes[2] not in manager.cached_block_hashes("full")
    manager.append("r", 2)
    assert manager.cache_blocks("r", hashes, 12) == 1 and hashes[2] in manager.cached_block_hashes("full")
    with pytest.raises(ValueError):
        manager.cache_blocks("r", hashes, 16)             # past capacity 15
    manager.check_integrity()
