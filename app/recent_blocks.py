"""What the router's own placements left in each replica's cache, and what a new one would evict.

Full caches (a server's steady state: every page holds some old prefix, so
no replica has empty pages to rank by) would leave new prefixes to chance:
one replica given more than its share evicts the newest of them before their
next question. So the router remembers the blocks it sent to each replica,
in the order it last sent them, as many as all replicas together hold
(``RecentBlocks``): if only this router places there and the replicas evict
the least recently used block first, a replica's cache is its newest
``capacity`` of them. That gives two things per decision:

    share(X)       blocks sent to X among the recent ones: among replicas equal in cost, the one with
                   the fewest takes a new prefix (app.routing's tie-break)
    evicted(X, n)  of X's cached blocks, the oldest  max(0, cached + n - capacity)  leave when n new
                   blocks land there (LRU)

A block pushed out of a cache costs its prefix's hits there, on every later
request (a prefix whose head is gone misses whole). The cheapest place for a
new prefix is the one whose victims are the least recently used of all, as if
the replicas were one LRU cache; a victim newer than that place's newest
victim is one this placement throws away without need::

    hot_victims(X) = |{v in evicted(X, n): v was sent more recently than the newest victim of the
                                            candidate whose newest victim is oldest}|
                     (every victim, when some candidate can take the n blocks without evicting)

    burst of new prefixes of 136 blocks, capacity 512, caches full of older prefixes:
        A holds 3 burst prefixes + 104 old blocks; a 4th there evicts 104 old and 32 of burst prefix 1
        B holds 2 burst prefixes + 240 old blocks; a 3rd there evicts 136 old
        hot_victims(A) = 32 (newer than B's newest victim), hot_victims(B) = 0: B, whatever the queues

The blocks are hashed names (kvcache.block_hashes): a block shared by two
prompts is one entry, owned by the replica it was last sent to.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any


class RecentBlocks:
    """The block names this router sent to each replica, the most recent ``capacity`` of them over
    all replicas (module docstring)."""

    def __init__(self) -> None:
        self.owner: OrderedDict[bytes, Any] = OrderedDict()  # name -> the replica it was last sent to
        self.num_by_replica: Counter = Counter()

    def add(self, replica_id: Any, names: Iterable[bytes], capacity: int) -> None:
        for name in names:
            previous = self.owner.pop(name, None)
            if previous is not None:
                self.num_by_replica[previous] -= 1
            self.owner[name] = replica_id
            self.num_by_replica[replica_id] += 1
        while len(self.owner) > max(capacity, 0):
            _, replica = self.owner.popitem(last=False)
            self.num_by_replica[replica] -= 1

    def num_blocks(self, replica_id: Any) -> int:
        return self.num_by_replica[replica_id]

    def retain(self, replica_ids: Iterable[Any]) -> None:
        """Forget replicas that are no longer candidates (a new replica starts with none)."""
        keep = set(replica_ids)
        for name in [n for n, r in self.owner.items() if r not in keep]:
            self.num_by_replica[self.owner.pop(name)] -= 1
        self.num_by_replica = Counter({r: n for r, n in self.num_by_replica.items() if r in keep})

    def hot_victims(self, demands: Mapping[Any, tuple[int, int]]) -> dict[Any, int]:
        """Per replica, ``hot_victims`` of the module docstring. ``demands``: replica -> (its capacity in
        blocks, the new blocks the request would bind there)."""
        cached: dict[Any, list[int]] = {r: [] for r in demands}  # age of each cached block, newest first
        for age, replica in enumerate(reversed(self.owner.values())):  # age 0: sent last
            blocks = cached.get(replica)
            if blocks is not None and len(blocks) < demands[replica][0]:
                blocks.append(age)
        victims = {}
        for replica, (capacity, num_new) in demands.items():
            blocks = cached[replica]
            num_evicted = min(len(blocks), max(0, len(blocks) + num_new - capacity))
            victims[replica] = blocks[len(blocks) - num_evicted:]
        evicting = [ages for ages in victims.values() if ages]
        if len(evicting) < len(victims) or not evicting:  # some candidate evicts nothing: every victim is needless
            return {replica: len(ages) for replica, ages in victims.items()}
        oldest_newest = max(ages[0] for ages in evicting)  # the newest victim that some candidate must lose
        return {replica: sum(age < oldest_newest for age in ages) for replica, ages in victims.items()}


def capacity_in_blocks(stats: Iterable[dict]) -> int:
    """Blocks all replicas together can hold: each one's pages over its groups (a block takes a
    page in every group)."""
    return sum(replica_capacity(s) for s in stats)


def replica_capacity(stats: dict) -> int:
    """Blocks one replica can hold (``capacity_in_blocks``)."""
    return int(stats.get("num_total_pages") or 0) // max(1, len(stats.get("windows") or {}))
