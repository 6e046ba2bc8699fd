"""KV-aware request routing on Ray Serve's request-router API, for context and generation replicas.

Serve's default router (power of two choices) looks at queue lengths only, so
requests that share a prefix land anywhere and a prefix cache rarely pays.
Here each worker replica reports, every stats period (``record_routing_stats``),
a Bloom-filter summary of the blocks it caches per layer group
(kvcache.summary), its queued prefill tokens and free pages. The ingress
hashes each prompt's blocks once (kvcache.hashing) and passes them with the
request in a ``RoutingHint``. Per candidate replica the router then computes
the hit the prompt would get there by the window-aware rule (kvcache.prefix:
a window group needs only the blocks a query at the hit can read, so a
replica holding only a prefix's stale head is not credited), and ranks by

    cost = prefill_load_scale * max(queued_prefill_tokens + P - hit, 0)
         + decode_load_scale * ongoing_requests
         + eviction_scale * hot_victim_tokens
         + (FULL_PENALTY if the replica's free pages cannot hold the uncached part)

``P - hit`` is the prefill work (context side, and a generation replica that
prefills locally) or the pages to pull (a generation replica receiving the KV:
``hit`` then counts the slice blocks it holds, by ordinal,
``ReplicaView.pull_hit``) this replica would add; ``hot_victim_tokens`` the
blocks the uncached part would push out of the replica's cache that are newer
than what another candidate would push out (app.recent_blocks: the replicas'
caches as the router's own placements filled them, least recently used out
first; a lost block is recomputed on every later hit it would have served,
hence the scale, 8 by default); ``queued_prefill_tokens`` the prefill work
ahead of it there; ``ongoing_requests`` Serve's own queue length (or the
replica's running + waiting when Serve has none yet; a live 0 from Serve
zeroes a stale ``queued_prefill_tokens``). Among equal costs (a prompt no
replica holds, no queues: every new conversation at low load) the replica
holding the fewest of the blocks this router sent out recently ranks first
(app.recent_blocks), then the one with the most empty pages (free and holding
no cached block), so new prefixes spread by cache footprint, not by chance:
the caches of N replicas then hold N times the prefixes of one, where a random
spread overfills one replica's cache while another's stands empty. Replicas
that have not reported rank last.

The router counts its own decisions (app.pending): a request's blocks join its
view of the replica it was sent to at once, and the pages they take leave that
view's free and empty pages, until a report of the replica shows the request.
A burst of new prefixes within one report period thus spreads by what each
replica will hold, not by what it held a period ago, also with every cache full
(no empty pages anywhere: the recent blocks decide). Serve takes the first replica of the first rank
that accepts (its queue below ``max_ongoing_requests``).

Sticky cancellation: an ``abort`` must reach the replica that holds the
request, not any replica. The router remembers which replica each request id
was routed to (bounded, most recent first) and sends ``abort`` there.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from app.pending import PendingDecisions, with_pending
from app.recent_blocks import RecentBlocks, capacity_in_blocks, replica_capacity
from kvcache import BlockSummary, hit_for_windows, stale_end

ROUTER_PATH = "app.routing:KVAwareRequestRouter"
FULL_PENALTY = 1e12
NUM_REMEMBERED_REQUESTS = 100_000


@dataclass(frozen=True)
class RoutingHint:
    """What the router needs of a request; workers ignore it. ``block_hashes``: the prompt's
    full blocks (kvcache.block_hashes with ``fingerprint`` as extra)."""

    request_id: str
    num_prompt_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    fingerprint: bytes = b""
    is_transfer: bool = False  # a generation replica receives the prompt's KV (scored by ReplicaView.pull_hit)


@dataclass(frozen=True)
class ReplicaView:
    """A replica's routing stats, parsed once per decision."""

    num_free_pages: int | None = None
    num_empty_pages: int = 0  # free pages that hold no cached block: taking them evicts nothing
    num_total_pages: int | None = None
    num_ongoing: int = 0
    queued_prefill_tokens: int = 0
    tokens_per_block: int = 0
    fingerprint: bytes = b""
    windows: dict[str, int | None] = field(default_factory=dict)
    summaries: Mapping[str, Container[bytes]] = field(default_factory=dict)  # BlockSummary, or app.pending's
    accounted_ids: frozenset[str] = frozenset()  # requests whose blocks this report shows (app.pending)

    @classmethod
    def from_stats(cls, stats: dict[str, Any]) -> ReplicaView | None:
        """None when the replica has not reported yet."""
        if not isinstance(stats.get("num_free_pages"), int):
            return None
        summaries = {g: BlockSummary.from_bytes(b) for g, b in (stats.get("cache_summaries") or {}).items()}
        return cls(
            num_free_pages=stats["num_free_pages"],
            num_empty_pages=int(stats.get("num_empty_pages") or 0),
            num_total_pages=stats.get("num_total_pages"),
            num_ongoing=int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0)),
            queued_prefill_tokens=int(stats.get("queued_prefill_tokens", 0)),
            tokens_per_block=int(stats.get("tokens_per_block", 0)),
            fingerprint=stats.get("kv_fingerprint", b""),
            windows=dict(stats.get("windows") or {}),
            summaries=summaries,
            accounted_ids=frozenset(stats.get("accounted_request_ids") or ()),
        )

    def hit(self, hint: RoutingHint) -> int:
        """Tokens of the prompt this replica's cache would serve: by the window-aware rule when it
        computes the prompt, by ``pull_hit`` when it receives the prompt's KV."""
        usable = self.summaries and hint.block_hashes and hint.fingerprint == self.fingerprint
        if not usable or set(self.summaries) != set(self.windows):
            return 0
        if hint.is_transfer:
            return self.pull_hit(hint)
        return hit_for_windows(self.windows, self.tokens_per_block, self.summaries, hint.block_hashes,
                               hint.num_prompt_tokens)

    def pull_hit(self, hint: RoutingHint) -> int:
        """A transfer skips, by ordinal, the slice blocks the receiver holds (kvcache.plan_pull);
        the hit is the prompt's share of slice blocks held here, in tokens::

            per group: slice = ordinals [stale_end(P, W, B), ceil(P / B)); held = those in the summary
            hit = P * sum(held) // sum(len(slice))

        No prefix rule here: a window group's stale head never travels, so a receiver that holds
        only a prefix's full-group blocks still saves their pages (the prefix rule would give 0).
        """
        P, B = hint.num_prompt_tokens, self.tokens_per_block
        num_blocks = -(-P // B)
        num_slice = num_held = 0
        for name, window in self.windows.items():
            first = stale_end(P, window, B)
            num_slice += num_blocks - first
            num_held += sum(h in self.summaries[name] for h in hint.block_hashes[first:num_blocks])
        return P * num_held // num_slice if num_slice else 0

    def can_hold(self, num_tokens: int) -> bool:
        """Whether its free pages (all groups together) can bind ``num_tokens`` more in every group."""
        if not self.tokens_per_block or not self.windows:
            return True
        pages = math.ceil(num_tokens / self.tokens_per_block) * len(self.windows)
        return self.num_free_pages is None or pages <= self.num_free_pages


@dataclass(frozen=True)
class CostScales:
    prefill_load_scale: float = 1.0
    decode_load_scale: float = 64.0
    eviction_scale: float = 8.0

    def __post_init__(self) -> None:
        if min(self.prefill_load_scale, self.decode_load_scale, self.eviction_scale) < 0:
            raise ValueError(f"scales must be >= 0, got {self}")


def replica_cost(view: ReplicaView, uncached: int, num_ongoing: int | None, scales: CostScales,
                 num_hot_victims: int = 0) -> float:
    """The module docstring's cost; lower is better. ``uncached``: ``P - hit`` there.

    ``num_ongoing``: Serve's live count of the requests at the replica (incremented on send,
    decremented on completion), None when it has none. Live 0 means nothing is queued there,
    whatever the report (a period old) says: after a burst, a stale ``queued_prefill_tokens``
    sent the next questions of the burst's prefixes away from the replicas that held them."""
    ongoing = view.num_ongoing if num_ongoing is None else num_ongoing
    queued = 0 if num_ongoing == 0 else view.queued_prefill_tokens
    cost = (scales.prefill_load_scale * (queued + uncached) + scales.decode_load_scale * ongoing
            + scales.eviction_scale * num_hot_victims * view.tokens_per_block)
    return cost if view.can_hold(uncached) else cost + FULL_PENALTY


def rank_replicas(
    replicas: Sequence[Any], hint: RoutingHint | None, queue_len: Callable[[Any], int | None], scales: CostScales,
    pending_of: Callable[[Any, ReplicaView], Sequence[RoutingHint]] = lambda replica, view: (),
    recent_of: Callable[[Any], int] = lambda replica: 0,
    hot_victims_of: Callable[[list[tuple[Any, tuple[int, int]]]], list[int]] = lambda demands: [0] * len(demands),
) -> list[list[Any]]:
    """One rank per reported replica, cheapest first (equal costs: the fewest blocks this router
    sent there recently first, then the most empty pages), then the unreported ones as one rank.

    ``replicas``: anything with ``routing_stats``; ``hint`` None (no prompt) scores load only.
    ``pending_of(replica, view)``: the requests sent there that ``view`` (its report) does not show yet.
    ``recent_of(replica)``: app.recent_blocks.RecentBlocks' share of that replica.
    ``hot_victims_of([(replica, (capacity in blocks, new blocks)), ...])``: RecentBlocks.hot_victims, in order.
    """
    hint = hint or RoutingHint("")
    shuffled = random.sample(list(replicas), len(replicas))  # fair among equal costs and footprints
    viewed, unknown = [], []
    for replica in shuffled:
        view = ReplicaView.from_stats(replica.routing_stats or {})
        if view is None:
            unknown.append(replica)
        else:
            viewed.append((replica, with_pending(view, pending_of(replica, view))))
    uncached = [max(hint.num_prompt_tokens - view.hit(hint), 0) for _, view in viewed]  # its prefill or pull
    demands = [(r, (replica_capacity(r.routing_stats), n // v.tokens_per_block if v.tokens_per_block else 0))
               for (r, v), n in zip(viewed, uncached)]  # capacity and new full blocks, in blocks
    hot_victims = hot_victims_of(demands) if hint.block_hashes else [0] * len(viewed)
    scored = []
    for (replica, view), num_uncached, num_hot in zip(viewed, uncached, hot_victims, strict=True):
        cost = replica_cost(view, num_uncached, queue_len(replica), scales, num_hot)
        scored.append((cost, recent_of(replica), -view.num_empty_pages, replica))
    scored.sort(key=lambda entry: entry[:3])
    return [[entry[-1]] for entry in scored] + ([unknown] if unknown else [])


def hint_of(pending_request: PendingRequest | None) -> RoutingHint | None:
    """The request's ``hint=``, recognised by its fields: Serve hands the router a class
    it deserialised itself, whose module copy has its own ``RoutingHint`` class, so an
    ``isinstance`` check fails on hints the ingress built (seen on Ray 2.60)."""
    if pending_request is None:
        return None
    hint = pending_request.kwargs.get("hint")
    if not all(hasattr(hint, f.name) for f in dataclasses.fields(RoutingHint)):
        return None
    return RoutingHint(**{f.name: getattr(hint, f.name) for f in dataclasses.fields(RoutingHint)})


class KVAwareRequestRouter(RequestRouter):
    """``request_router_kwargs``: ``prefill_load_scale``, ``decode_load_scale``, ``eviction_scale``
    (CostScales).

    A decision is counted when it is made, not when the replica accepts the request: Serve's
    router reports acceptance (``on_request_routed``) a round trip later, and a burst's requests
    are all chosen before the first comes back; counted on acceptance, they were all placed on the
    same view (the queue lengths alone spread them). The top choice is counted at once, and moved
    if Serve sent the request elsewhere (its first choice was full). No ``FIFOMixin``: Serve then
    gives each choice to the request it was made for, not to the oldest request waiting."""

    def initialize_state(self, prefill_load_scale: float = 1.0, decode_load_scale: float = 64.0,
                         eviction_scale: float = 8.0, **kwargs: Any) -> None:
        self.scales = CostScales(prefill_load_scale, decode_load_scale, eviction_scale)
        self.placements: OrderedDict[str, Any] = OrderedDict()  # request id -> replica id
        self.pending = PendingDecisions()
        self.recent = RecentBlocks()
        self.capacity_blocks = 0  # all candidates' blocks, as of the last decision (RecentBlocks' bound)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = hint_of(pending_request)
        if hint is not None and pending_request.metadata.call_method == "abort":
            holder = [r for r in candidate_replicas if r.replica_id == self.placements.get(hint.request_id)]
            if holder:
                return [holder]
        cache = self.replica_queue_len_cache
        current = getattr(self, "curr_replicas", None) or [r.replica_id for r in candidate_replicas]
        self.pending.retain(current)
        self.recent.retain(current)
        self.capacity_blocks = capacity_in_blocks(r.routing_stats or {} for r in candidate_replicas)
        ranks = rank_replicas(candidate_replicas, hint, lambda r: cache.get(r.replica_id), self.scales,
                              self._pending_of, lambda r: self.recent.num_blocks(r.replica_id), self._hot_victims_of)
        if hint is not None and ranks and ranks[0]:
            self._count(ranks[0][0].replica_id, hint)  # provisional: on_request_routed moves it if need be
        return ranks

    def _hot_victims_of(self, demands: list[tuple[RunningReplica, tuple[int, int]]]) -> list[int]:
        by_id = self.recent.hot_victims({r.replica_id: demand for r, demand in demands})
        return [by_id[r.replica_id] for r, _ in demands]

    def _pending_of(self, replica: RunningReplica, view: ReplicaView) -> list[RoutingHint]:
        self.pending.reconcile(replica.replica_id, view.accounted_ids)
        return self.pending.hints(replica.replica_id)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: Any, result: Any) -> None:
        hint = hint_of(pending_request)
        if hint is None or pending_request.metadata.call_method == "abort":
            return
        self.placements[hint.request_id] = replica_id
        self.placements.move_to_end(hint.request_id)
        self._count(replica_id, hint)
        while len(self.placements) > NUM_REMEMBERED_REQUESTS:
            self.placements.popitem(last=False)

    def _count(self, replica_id: Any, hint: RoutingHint) -> None:
        """The request's blocks join the router's view of ``replica_id`` (app.pending, app.recent_blocks)."""
        if hint.block_hashes:
            self.pending.add(replica_id, hint)
            self.recent.add(replica_id, hint.block_hashes, self.capacity_blocks)
