"""app.recent_blocks: the router's own placements model each replica's cache; a new prefix goes where
it evicts the least recently used blocks of all, so a burst of new prefixes fits where a balanced
placement fits, whatever the replicas' queue lengths."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from app.pending import PendingDecisions
from app.recent_blocks import RecentBlocks, capacity_in_blocks
from app.routing import ReplicaView, RoutingHint, rank_replicas
from tests.app.test_pending import hint_of, tokens
from tests.app.test_routing import SCALES, WINDOWS, B, replica

CAPACITY = 1000 // len(WINDOWS)  # blocks per replica of test_routing's replica(): 1000 pages, 2 groups


def send_counting_recent(replicas, hint: RoutingHint, decisions: PendingDecisions, recent: RecentBlocks,
                         queue_len=lambda r: None, scales=SCALES) -> str:
    """One decision as KVAwareRequestRouter makes it (pending decisions, recent blocks, hot victims):
    the chosen replica's name."""
    def pending_of(r, view: ReplicaView):
        decisions.reconcile(r.name, view.accounted_ids)
        return decisions.hints(r.name)

    def hot_victims_of(demands):
        by_name = recent.hot_victims({r.name: d for r, d in demands})
        return [by_name[r.name] for r, _ in demands]

    capacity = capacity_in_blocks(r.routing_stats for r in replicas)
    first = rank_replicas(replicas, hint, queue_len, scales, pending_of, lambda r: recent.num_blocks(r.name),
                          hot_victims_of)[0][0]
    decisions.add(first.name, hint)
    recent.add(first.name, hint.block_hashes, capacity)
    return first.name


@settings(max_examples=30, deadline=None)
@given(num_replicas=st.integers(2, 4), num_prefixes=st.integers(2, 12), num_blocks=st.integers(2, 40),
       num_questions=st.integers(1, 3))
def test_with_every_cache_full_new_prefixes_spread_evenly_and_repeats_follow(num_replicas, num_prefixes,
                                                                            num_blocks, num_questions):
    """A server's steady state: every replica's pages hold old prefixes (0 empty), reports stay as they
    were. New prefixes spread by the blocks the router sent to each replica: no replica gets two more
    than another, whatever the (random) order among equals; each prefix's questions follow it."""
    names = [f"r{i}" for i in range(num_replicas)]
    replicas = [replica(n, empty=0) for n in names]
    decisions, recent = PendingDecisions(), RecentBlocks()
    prefixes = [tokens(seed, num_blocks * B) for seed in range(1, num_prefixes + 1)]
    placed = [send_counting_recent(replicas, hint_of(f"new-{i}", p + tokens(300 + i, 5)), decisions, recent)
              for i, p in enumerate(prefixes)]
    per_replica = [placed.count(n) for n in names]
    assert max(per_replica) - min(per_replica) <= 1, placed
    for q in range(num_questions):
        repeats = [send_counting_recent(replicas, hint_of(f"q{q}-{i}", p + tokens(400 + 10 * i + q, 7)), decisions,
                                        recent) for i, p in enumerate(prefixes)]
        assert repeats == placed


def test_recent_blocks_keep_the_newest_up_to_capacity_and_follow_a_block_that_moved():
    recent = RecentBlocks()
    recent.add("a", [b"0", b"1", b"2"], capacity=4)
    recent.add("b", [b"3", b"4"], capacity=4)  # b"0" is the oldest: dropped
    assert list(recent.owner.items()) == [(b"1", "a"), (b"2", "a"), (b"3", "b"), (b"4", "b")]
    assert (recent.num_blocks("a"), recent.num_blocks("b")) == (2, 2)
    recent.add("b", [b"1"], capacity=4)  # sent to b now: b's, and the most recent
    assert list(recent.owner.items()) == [(b"2", "a"), (b"3", "b"), (b"4", "b"), (b"1", "b")]
    assert (recent.num_blocks("a"), recent.num_blocks("b")) == (1, 3)
    recent.retain(["a"])  # b is gone (dead, scaled down): its blocks leave with it
    assert list(recent.owner.items()) == [(b"2", "a")] and recent.num_blocks("b") == 0


def test_capacity_is_each_replicas_pages_over_its_groups():
    stats = [replica("r0").routing_stats, replica("r1").routing_stats, {}]
    assert capacity_in_blocks(stats) == 2 * CAPACITY


def test_hot_victims_are_the_evicted_blocks_newer_than_the_least_needed_eviction():
    """The module docstring's example, in small: capacity 4 blocks each. A holds (oldest first) o1 n1 n2
    n3, B holds o2 o3 n4 n5, all n newer than all o. Two new blocks: A loses o1 n1, B loses o2 o3.
    B's newest victim (o3) is older than A's (n1): B evicts nothing needed; A's n1 is newer than o3."""
    recent = RecentBlocks()
    for owner, name in [("A", b"o1"), ("B", b"o2"), ("B", b"o3"), ("A", b"n1"), ("A", b"n2"), ("A", b"n3"),
                        ("B", b"n4"), ("B", b"n5")]:
        recent.add(owner, [name], capacity=8)
    assert recent.hot_victims({"A": (4, 2), "B": (4, 2)}) == {"A": 1, "B": 0}
    assert recent.hot_victims({"A": (4, 2), "B": (5, 1)}) == {"A": 2, "B": 0}  # B has room: A's loss is all needless
    assert recent.hot_victims({"A": (4, 0), "B": (4, 4)}) == {"A": 0, "B": 4}  # a full hit on A evicts nothing


class CachedReplica:
    """A replica whose cache is LRU over block names (a request touches its prompt's blocks in order);
    its reports show exactly what it holds, and all its pages are free to evict (0 empty)."""

    def __init__(self, name: str, capacity: int = CAPACITY) -> None:
        self.name, self.capacity = name, capacity
        self.lru: OrderedDict[bytes, None] = OrderedDict()
        self._stats: dict | None = None  # built once per change of the cache

    @property
    def routing_stats(self) -> dict:
        if self._stats is None:
            self._stats = replica(self.name, {g: list(self.lru) for g in WINDOWS}, empty=0).routing_stats
        return self._stats

    def holds(self, names) -> bool:
        return all(n in self.lru for n in names)

    def serve(self, names) -> None:
        self._stats = None
        for name in names:
            self.lru[name] = None
            self.lru.move_to_end(name)
        while len(self.lru) > self.capacity:
            self.lru.popitem(last=False)


@settings(max_examples=15, deadline=None)
@given(num_blocks=st.integers(100, 160), num_old=st.integers(6, 12), num_new=st.integers(6, 9),
       idle=st.lists(st.integers(0, 2), min_size=9, max_size=9))
def test_a_burst_of_new_prefixes_on_full_caches_fits_where_a_balanced_placement_fits(num_blocks, num_old, num_new,
                                                                                      idle):
    """Issue 28's 3 x 8 burst: 3 replicas of 500 blocks, full of ``num_old`` older prefixes the router
    placed; then ``num_new`` new prefixes at once (3 fit in one replica: 3 x ``num_blocks`` <= 480), with
    Serve's live queue lengths 0 on one replica (``idle[i]``, the one whose prefill ended first) and 1
    on the others; then 3 rounds of one question per new prefix. Every question finds its whole prefix
    in the cache of the replica it is sent to. By load alone the idle replicas took more than fit."""

    def run(scales) -> tuple[list[bool], list[int]]:
        replicas = [CachedReplica(f"r{i}") for i in range(3)]
        decisions, recent = PendingDecisions(), RecentBlocks()

        def send(hint, queue_len=lambda r: None) -> tuple[CachedReplica, bool]:
            """Route, then serve there; whether the chosen cache held the prefix's blocks on arrival."""
            name = send_counting_recent(replicas, hint, decisions, recent, queue_len, scales)
            decisions.reconcile(name, {hint.request_id})  # its report shows it at once: only the cache speaks
            chosen = next(r for r in replicas if r.name == name)
            held = chosen.holds(hint.block_hashes[:num_blocks])
            chosen.serve(hint.block_hashes)
            return chosen, held

        for i in range(num_old):
            send(hint_of(f"old-{i}", tokens(900 + i, num_blocks * B)))
        prefixes = [tokens(500 + i, num_blocks * B) for i in range(num_new)]
        burst = [send(hint_of(f"new-{i}", p + tokens(600 + i, 5)),
                      lambda r, i=i: 0 if r.name == f"r{idle[i]}" else 1)[0] for i, p in enumerate(prefixes)]
        hits = [send(hint_of(f"q{q}-{i}", p + tokens(700 + 10 * i + q, 7)))[1]
                for q in range(3) for i, p in enumerate(prefixes)]
        return hits, [burst.count(r) for r in replicas]

    hits, per_replica = run(SCALES)
    assert all(hits), (hits, per_replica)
    assert max(per_replica) <= 3
    by_load_alone, _ = run(dataclasses.replace(SCALES, eviction_scale=0.0))
    if len(set(idle[:num_new])) == 1:  # one replica idle throughout: by load alone it took every new prefix
        assert not all(by_load_alone)
