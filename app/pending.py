"""The router's own decisions, counted until the replica's report shows them.

A replica reports what it caches once per report period (app.serve_workers'
``REPORT_PERIOD_S``, 1 s), and Serve hands the report to the router up to a
period later. A router that ranked by reports alone placed every new prefix
of a burst on the same stale view: one replica filled and evicted while the
other still had room (issue 28). So the router adds a request's blocks to its
view of a replica the moment it sends the request there, and drops them once
a report of that replica shows the request::

    choose X for r         pending[X][r] = r's hint                   (choose_replicas; on_request_routed moves it
                                                                      if Serve sent r elsewhere)
    X reports r            pending[X].pop(r)     X lists r in ``accounted_request_ids``: its report was
                                                 built after r's blocks were cached (or r ended), so the
                                                 report's summary now says where they are, evicted or not
    r pending too long     dropped after PENDING_MAX_AGE_S            (a lost report, a replica gone)

Each ingress replica runs its own router and counts its own decisions; the
others' reach it through the reports.

Full caches, where no replica has empty pages to rank by, are app.recent_blocks'.

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
from collections import OrderedDict
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
        """Count ``hint`` at ``replica_id``, and at no other replica (a provisional choice that Serve
        then sent elsewhere moves)."""
        for other, entries in self.by_replica.items():
            if other != replica_id:
                entries.pop(hint.request_id, None)
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
