"""The worker deployments: one replica = one Ray actor = one actors/ worker, and the stats board.

    ContextWorker, GenerationWorker, AggregatedWorker (WorkerReplica each)
        every REPORT_PERIOD_S: the worker's stats ──► WorkerStats (one replica) ◄── GET /metrics
                               and its routing stats ──► Serve's router (app.routing)

A handle call reaches one replica, so /metrics cannot ask every replica
itself: each replica pushes its page counts to ``WorkerStats``, which forgets
a replica that stopped reporting. The same numbers, with the engine's routing
stats (queued prefill tokens, windows, fingerprint, a Bloom filter of cached
blocks per group), are the replica's routing stats (app.routing); the ingress
reads the generation replicas' filters from the board too, to decide on a
local prefill (app.placement). Deployment names are the ones a Serve config's
``deployments:`` list overrides (num_replicas, ray_actor_options,
autoscaling_config, request_router_config, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sized

from ray import serve
from ray.serve.handle import DeploymentHandle

from actors.aggregated_worker import AggregatedWorker
from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from actors.messages import KVHandle, Prefilled
from actors.worker_base import EngineWorker
from app.planner_stats import ContextStats, GenerationStats
from app.routing import ROUTER_PATH, RoutingHint
from engine.outputs import RequestUpdate, stamp
from engine.params import SamplingParams

log = logging.getLogger(__name__)
REPORT_PERIOD_S = 1.0
STALE_AFTER_S = 5 * REPORT_PERIOD_S
# Worker stats keys passed on to /metrics (app.metrics) and the router (app.routing).
METRICS_KEYS = ("num_free_pages", "num_empty_pages", "num_total_pages", "num_running", "num_waiting", "num_cancelled",
                "kv_transfers", "kv_transfer_bytes", "kv_transfer_seconds", "num_drafts_proposed",
                "num_drafts_accepted", "prefix_cache_queries", "prefix_cache_hits", "num_abort_calls",
                "num_transfer_fallbacks")
ROUTING_KEYS = ("num_free_pages", "num_empty_pages", "num_total_pages", "num_running", "num_waiting",
                "queued_prefill_tokens", "tokens_per_block", "windows", "kv_fingerprint", "cache_summaries",
                "accounted_request_ids")
# A request's id stays in its replica's reports this long after its blocks were cached (or it ended), so
# that every router hears it at least once (a report a period, Serve's poll a period, slack for load);
# the router then drops its own pending entry for it (app.pending).
ACCOUNTED_KEEP_S = 5 * REPORT_PERIOD_S
# A killed replica is noticed at the controller's next health check of it (Serve's default period: 10 s),
# then replaced (~6 s here: process, imports, engine). The check is Serve's own ping, answered on the
# replica's main loop (we define no check_health): an engine step (a thread, actors.engine_loop) or a
# blocked user loop does not delay it, and a replica is killed only after 3 checks in a row go
# unanswered for HEALTH_CHECK_TIMEOUT_S each (>= 30 s); under long prefills it answers in 6 ms (max 0.18 s).
HEALTH_CHECK_PERIOD_S = 1.0
HEALTH_CHECK_TIMEOUT_S = 10.0
WORKER_OPTIONS = dict(
    ray_actor_options={"num_cpus": 0},  # workers set their own torch threads
    health_check_period_s=HEALTH_CHECK_PERIOD_S,  # a Serve config's deployments: entry overrides both
    health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
    request_router_config={"request_router_class": ROUTER_PATH, "request_routing_stats_period_s": REPORT_PERIOD_S},
)


def metrics_entry(name: str, role: str, stats: dict) -> dict:
    """A worker's ``stats()`` in app.metrics' schema."""
    entry = {"name": name, "role": role, **{key: stats[key] for key in METRICS_KEYS if key in stats}}
    if "num_free_pages" in entry and "num_total_pages" in entry:
        entry["pages_in_use"] = entry["num_total_pages"] - entry["num_free_pages"]
    return entry


@serve.deployment(name="WorkerStats", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  logging_config={"enable_access_log": False})  # a report per replica per second
class WorkerStats:
    """The latest stats of every worker replica, by replica name."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, dict]] = {}

    async def report(self, entry: dict) -> None:
        self._entries[entry["name"]] = (time.monotonic(), entry)

    async def snapshot(self) -> list[dict]:
        horizon = time.monotonic() - STALE_AFTER_S
        self._entries = {name: e for name, e in self._entries.items() if e[0] >= horizon}
        return [entry for _, (_, entry) in sorted(self._entries.items())]


class WorkerReplica:
    """What every worker deployment shares: abort, stats (pushed to WorkerStats), ping.

    Lifecycle: Serve awaits an async ``__init__`` (it awaits the deployment's
    constructor on the replica's event loop), which starts the worker once;
    when Serve stops the replica it drains its requests, then awaits
    ``__del__``, which shuts the worker down (transport closed, peer record
    unpublished).
    """

    async def __init__(self, role: str, worker: EngineWorker, board: DeploymentHandle) -> None:
        context = serve.get_replica_context()
        self.role = role
        self.worker = worker
        self.board = board
        self.name = f"{context.deployment}#{context.replica_id.unique_id}"
        self.num_cancelled = 0  # streams whose caller went away (client disconnects)
        self.num_abort_calls = 0  # aborts routed here (sticky: to the replica holding the request)
        self._latest: dict = {}
        self._accounted: OrderedDict[str, float] = OrderedDict()  # request id -> when its blocks were cached
        await worker.start()
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    async def abort(self, request_id: str, hint: RoutingHint | None = None) -> bool:
        """``hint`` (ignored here) lets the router send the abort to the replica holding the request."""
        self.num_abort_calls += 1
        return await self.worker.abort(request_id)

    async def ping(self) -> str:
        return self.name

    async def stats(self) -> dict:
        return {**await self.worker.stats(), "num_cancelled": self.num_cancelled,
                "num_abort_calls": self.num_abort_calls, "replica": self.name}

    async def record_routing_stats(self) -> dict:
        """The latest report's routing keys, built in ``_report_forever`` (not per call): the page
        counts and a few ints, plus per layer group a Bloom filter of ``~1.2`` bytes per page
        of its pool (kvcache.summary): ``~2.5 KB`` a group at 2048 pages, ``120 KB`` at 100k."""
        return {k: self._latest[k] for k in ROUTING_KEYS if k in self._latest}

    def account(self, request_id: str) -> None:
        """Its blocks are in this replica's cache now (or it ended): reports built from now on show it."""
        self._accounted[request_id] = time.monotonic()
        self._accounted.move_to_end(request_id)

    def accounted_ids(self) -> list[str]:
        """The ids accounted within ACCOUNTED_KEEP_S; read before the cache is summarized, so that the
        summary of the same report includes their blocks."""
        horizon = time.monotonic() - ACCOUNTED_KEEP_S
        while self._accounted and next(iter(self._accounted.values())) < horizon:
            self._accounted.popitem(last=False)
        return list(self._accounted)

    async def _report_forever(self) -> None:
        while True:
            try:
                accounted = {"accounted_request_ids": self.accounted_ids()}
                entry = metrics_entry(self.name, self.role, await self.stats())
                self._latest = {**entry, **await self.worker.routing_stats(), **accounted}
                await self.board.report.remote(self._latest)
            except Exception:
                log.warning("stats report of %s failed", self.name, exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)

    async def _relay(self, request_id: str, updates: AsyncIterator[RequestUpdate]) -> AsyncIterator[RequestUpdate]:
        """Yield a worker's updates; a cancelled caller closes the worker's stream (abort, pages freed).
        The request is accounted at its first update (its prompt's or slice's blocks are cached then)."""
        async with contextlib.aclosing(updates):
            try:
                is_accounted = False
                async for update in updates:
                    if not is_accounted:
                        self.account(request_id)
                        is_accounted = True
                    stamp(update, "worker_yield")
                    yield update
            except (asyncio.CancelledError, GeneratorExit):
                self.num_cancelled += 1
                raise
            finally:
                self.account(request_id)

    async def __del__(self) -> None:
        # __init__ may have failed part way; Serve calls __del__ anyway
        reporter, worker = getattr(self, "_reporter", None), getattr(self, "worker", None)
        if reporter is not None:
            reporter.cancel()
        if worker is not None:
            await worker.shutdown()


async def drain_leases(leases: Sized, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Wait until no lease is held (each pulled and released, aborted, or lapsed: the worker's reaper
    frees those) or ``timeout_s`` passed; True if none is left."""
    deadline = time.monotonic() + timeout_s
    while len(leases) and time.monotonic() < deadline:
        await asyncio.sleep(poll_s)
    return not len(leases)


@serve.deployment(name="ContextWorker", **WORKER_OPTIONS)
class ContextDeployment(WorkerReplica):
    async def __init__(self, config: WorkerConfig, board: DeploymentHandle) -> None:
        self.planner_stats = ContextStats()
        await super().__init__("context", ContextWorker(config), board)

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      hint: RoutingHint | None = None) -> Prefilled:
        start = time.monotonic()
        try:
            prefilled = await self.worker.prefill(request_id, prompt_token_ids, params)
            cached = prefilled.kv.num_cached_tokens if prefilled.kv is not None else prefilled.first.num_cached_tokens
            self.planner_stats.on_prefill(prefilled.first.num_prompt_tokens, cached, time.monotonic() - start)
            return prefilled
        finally:
            self.account(request_id)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Windowed gauges for the P:D planner (app.planner_stats), sampled by Serve's autoscaler."""
        return self.planner_stats.report(self._latest)

    async def __del__(self) -> None:
        """A scale-down drains: Serve has routed nothing new here and waited out the ongoing prefills;
        the prompts they leased stay held until their KV is pulled or the lease lapses (a deployment's
        ``graceful_shutdown_timeout_s`` must allow ``lease_s``, configs/autoscale.yaml)."""
        worker = getattr(self, "worker", None)
        if worker is not None:
            timeout_s = max(worker.config.lease_s, worker.config.claim_s) + 1.0
            if not await drain_leases(worker.leases, timeout_s):
                log.warning("%s stops with %d leases held", self.name, len(worker.leases))
        await super().__del__()


@serve.deployment(name="GenerationWorker", **WORKER_OPTIONS)
class GenerationDeployment(WorkerReplica):
    async def __init__(self, config: WorkerConfig, board: DeploymentHandle) -> None:
        self.planner_stats = GenerationStats()
        await super().__init__("generation", GenerationWorker(config), board)

    async def generate(
        self, handle: KVHandle, prompt_token_ids: list[int], params: SamplingParams, hint: RoutingHint | None = None
    ) -> AsyncIterator[RequestUpdate]:
        request_id = hint.request_id if hint is not None else handle.request_id  # the id the router saw
        async for update in self._timed(self._relay(request_id, self.worker.generate(handle, prompt_token_ids,
                                                                                      params))):
            yield update

    async def generate_local(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, hint: RoutingHint | None = None
    ) -> AsyncIterator[RequestUpdate]:
        """Prefill here too (app.placement: a prompt whose uncached part is short)."""
        updates = self.worker.generate_local(request_id, prompt_token_ids, params)
        async for update in self._timed(self._relay(request_id, updates)):
            yield update

    async def _timed(self, updates: AsyncIterator[RequestUpdate]) -> AsyncIterator[RequestUpdate]:
        """Each update's tokens and its gap since the stream's previous one, for the planner's gauges."""
        async with contextlib.aclosing(updates):
            previous = None
            async for update in updates:
                now = time.monotonic()
                self.planner_stats.on_update(len(update.new_token_ids), None if previous is None else now - previous)
                if update.finish_reason is not None:
                    self.planner_stats.on_finished(update.num_output_tokens)
                previous = now
                yield update

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Windowed gauges for the P:D planner (app.planner_stats), sampled by Serve's autoscaler."""
        return self.planner_stats.report(self._latest)


class AggregatedReplica(WorkerReplica):
    """An aggregated worker's replica: the AggregatedWorker deployment's, and the ingress's own when the
    engine runs in the ingress (app.serve_app.EngineIngress)."""

    async def __init__(self, config: WorkerConfig, board: DeploymentHandle) -> None:
        await super().__init__("aggregated", AggregatedWorker(config), board)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, hint: RoutingHint | None = None
    ) -> AsyncIterator[RequestUpdate]:
        async with contextlib.aclosing(self._relay(request_id, self.worker.generate(request_id, prompt_token_ids,
                                                                                    params))) as updates:
            async for update in updates:
                yield update


@serve.deployment(name="AggregatedWorker", **WORKER_OPTIONS)
class AggregatedDeployment(AggregatedReplica):
    pass
