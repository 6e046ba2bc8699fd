"""Route worker requests by load: the most free KV pages among the least-queued replicas.

Serve's default router (power of two choices) looks at queue lengths only. A
worker's queue says little about its KV cache: ten short requests hold fewer
pages than one long one, and a generation worker with no free pages parks
new requests (extending the context lease) until pages free up. So:

    candidates ──► less loaded: queue_len <= min(queue_len) + queue_slack
                   (unknown queue lengths count as less loaded, as Serve does)
               ──► ranked by free page fraction, most free first, one per rank
               ──► then everyone else, as one rank (lowest queue wins there)

Serve walks the ranks in order and takes the first replica that accepts
(its queue below max_ongoing_requests). Free pages come from each replica's
``record_routing_stats`` (``num_free_pages``, ``num_total_pages``), which
Serve polls every ``request_routing_stats_period_s``; ``queue_slack`` keeps
a burst that arrives between two polls from piling onto one replica.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

ROUTER_PATH = "app.routing:KVAwareRequestRouter"


def free_page_fraction(stats: dict[str, Any]) -> float:
    """0..1, or -1 when the replica has not reported yet (ranked last among equals)."""
    free, total = stats.get("num_free_pages"), stats.get("num_total_pages")
    if not isinstance(free, int) or not isinstance(total, int) or total <= 0:
        return -1.0
    return free / total


def rank_replicas(
    replicas: Sequence[Any], queue_len: Callable[[Any], int | None], queue_slack: int
) -> list[list[Any]]:
    """Ranks of ``replicas`` (anything with ``routing_stats``); see the module docstring."""
    known = [q for q in map(queue_len, replicas) if q is not None]
    floor = min(known, default=0)
    shuffled = random.sample(list(replicas), len(replicas))  # fair among equals
    less_loaded = [r for r in shuffled if (queue_len(r) or 0) <= floor + queue_slack]
    rest = [r for r in shuffled if r not in less_loaded]
    less_loaded.sort(key=lambda r: free_page_fraction(r.routing_stats), reverse=True)
    return [[r] for r in less_loaded] + ([rest] if rest else [])


class KVAwareRequestRouter(FIFOMixin, RequestRouter):
    """``request_router_kwargs``: ``queue_slack`` (default 1)."""

    def initialize_state(self, queue_slack: int = 1, **kwargs: Any) -> None:
        if queue_slack < 0:
            raise ValueError(f"queue_slack must be >= 0, got {queue_slack}")
        self.queue_slack = queue_slack

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        cache = self.replica_queue_len_cache
        return rank_replicas(candidate_replicas, lambda r: cache.get(r.replica_id), self.queue_slack)
