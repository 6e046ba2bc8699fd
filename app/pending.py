"""The router's own decisions, counted until the replica's report shows them.

A replica reports what it caches once per report period (app.serve_app's
``REPORT_PERIOD_S``, 1 s), and Serve hands the report to the router up to a
period later. A router that ranked by reports alone placed every new prefix
of a burst on the same stale view: one replica filled and evicted while the
other still had room (issue 28). So the router adds a request's blocks to its
view of a replica the moment it sends the request there, and drops them once
a report of that replica shows the request::

    send r to X            pending[X][r] = r's hint                   (on_request_routed)
    X reports r            pending[X].pop(r)     X lists r in ``accounted_request_ids``: its report was
                                                 built after r's blocks were cached (or r ended), so the
                                                 report's summary now says where they are, evicted or not
    r pending too long     dropped after PENDING_MAX_AGE_S            (a lost report, a replica gone)

Each ingress replica runs its own router and counts its own decisions; the
others' reach it through the reports.

Full caches (a server's steady state: every page holds some old prefix, so
no replica has empty pages to rank by) would leave new prefixes to chance:
one replica given more than its share evicts the newest of them before their
next question. So the router also remembers the blocks it sent to each
replica, most recent last, as many as all replicas together hold
(``RecentBlocks``): what LRU caches keep of its own placements. Among replicas
equal in cost, a new prefix goes to the one holding the fewest of them, then
to the one with the most empty pages (which also show other routers' blocks)::

    sent: p0 -> A, p1 -> B, p2 -> ?   recent blocks A 137, B 137: either; p2 -> A
          p3 -> ?                     A 274, B 137: B      (the old prefixes on both are evicted alike)

The blocks a request takes on a replica, per group (``P`` prompt tokens, ``B``
tokens per block, only full blocks have names)::

    computes the prompt (context side, a local prefill):  ordinals [0, P // B)
    receives its KV (``is_transfer``):                    ordinals [stale_end(P, W, B), P // B)
                                                          (the slice; a window group's stale head never travels)

Per decision the view of X is its report plus its pending blocks, per group::

    held       = summary ∪ pending names           (the hit rule, window-aware, reads ``held``)
    new pages  = |pending names not in summary|     summed over groups; counted once however many
                                                    pending requests share them
    num_free_pages, num_empty_pages  -= new pages   (at least 0)
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvcache import stale_end

if TYPE_CHECKING:
    from app.routing import ReplicaView, RoutingHint

PENDING_MAX_AGE_S = 30.0
MAX_PENDING_PER_REPLICA = 4096


class HeldBlocks:
    """A group's reported summary plus the names the router sent there since: ``name in held``."""

    def __init__(self, reported: Container[bytes], pending: set[bytes]) -> None:
        self.reported = reported
        self.pending = pending

    def __contains__(self, name: object) -> bool:
        return name in self.pending or name in self.reported


def names_taken(hint: RoutingHint, window: int | None, tokens_per_block: int) -> Sequence[bytes]:
    """The block names ``hint``'s request binds in a group of ``window`` (module docstring)."""
    B, P = tokens_per_block, hint.num_prompt_tokens
    num_full = min(len(hint.block_hashes), P // B)
    first = stale_end(P, window, B) if hint.is_transfer else 0
    return hint.block_hashes[first:num_full]


def with_pending(view: ReplicaView, hints: Iterable[RoutingHint]) -> ReplicaView:
    """``view`` as it will be once the pending ``hints`` are cached there (module docstring)."""
    hints = [h for h in hints if h.block_hashes and h.fingerprint == view.fingerprint]
    if not hints or not view.tokens_per_block or set(view.summaries) != set(view.windows):
        return view
    held, num_new = {}, 0
    for name, window in view.windows.items():
        reported = view.summaries[name]
        pending = {n for h in hints for n in names_taken(h, window, view.tokens_per_block)}
        pending = {n for n in pending if n not in reported}
        held[name] = HeldBlocks(reported, pending)
        num_new += len(pending)
    free = None if view.num_free_pages is None else max(0, view.num_free_pages - num_new)
    return dataclasses.replace(view, summaries=held, num_free_pages=free,
                               num_empty_pages=max(0, view.num_empty_pages - num_new))


class PendingDecisions:
    """Per replica, the requests sent there that its reports do not show yet, oldest first."""

    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self.by_replica: dict[Any, OrderedDict[str, tuple[float, RoutingHint]]] = {}

    def add(self, replica_id: Any, hint: RoutingHint) -> None:
        entries = self.by_replica.setdefault(replica_id, OrderedDict())
        entries[hint.request_id] = (self.clock(), hint)
        entries.move_to_end(hint.request_id)
        while len(entries) > MAX_PENDING_PER_REPLICA:
            entries.popitem(last=False)

    def reconcile(self, replica_id: Any, accounted_ids: Container[str]) -> None:
        """Drop what the replica's report shows, and entries older than PENDING_MAX_AGE_S."""
        entries = self.by_replica.get(replica_id)
        if not entries:
            return
        horizon = self.clock() - PENDING_MAX_AGE_S
        for request_id, (sent_at, _) in list(entries.items()):
            if request_id in accounted_ids or sent_at < horizon:
                del entries[request_id]

    def retain(self, replica_ids: Iterable[Any]) -> None:
        """Forget replicas that are no longer candidates (dead, scaled down)."""
        keep = set(replica_ids)
        self.by_replica = {r: e for r, e in self.by_replica.items() if r in keep}

    def hints(self, replica_id: Any) -> list[RoutingHint]:
        return [hint for _, hint in self.by_replica.get(replica_id, {}).values()]


class RecentBlocks:
    """The block names this router sent to each replica, the most recent ``capacity`` of them over
    all replicas (module docstring): ``num_blocks(replica)`` is its share of them."""

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


def capacity_in_blocks(stats: Iterable[dict]) -> int:
    """Blocks all replicas together can hold: each one's pages over its groups (a block takes a
    page in every group)."""
    return sum(int(s.get("num_total_pages") or 0) // max(1, len(s.get("windows") or {})) for s in stats)
