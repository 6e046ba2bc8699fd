"""Prometheus metrics of one app, in its own CollectorRegistry.

Several apps may live in one process (tests, Serve replicas), so nothing is
registered in prometheus_client's global registry.

Two sources feed ``GET /metrics``:

* the HTTP layer itself: requests by route and status, time to first token,
  time per output token, tokens in and out, requests in flight;
* ``backend.stats()``, read at scrape time, whose per-worker entries become
  labelled series. The schema (every key but ``name`` optional; absent keys
  produce no sample)::

      {"workers": [{"name": "gen-0", "role": "generation",
                    "pages_in_use": 12, "num_free_pages": 500,
                    "kv_transfers": 40,                # cumulative, one per handoff pulled
                    "kv_transfer_bytes": 1048576,      # cumulative
                    "kv_transfer_seconds": 0.25,       # cumulative
                    "num_drafts_proposed": 900,        # cumulative
                    "num_drafts_accepted": 610,        # cumulative
                    "prefix_cache_queries": 40960,     # cumulative, prompt tokens looked up
                    "prefix_cache_hits": 30720}],      # cumulative, of those, tokens found
       "context_fallbacks": 2}                 # the ingress's own, cumulative: prompts prefilled on a
                                               # generation replica as no context replica answered

Prefix-cache queries and hits count tokens, as vLLM's ``prefix_cache_queries``
and ``prefix_cache_hits`` do, so ``rate(hits) / rate(queries)`` is the hit
rate: per role, a context (or aggregated) worker's lookups at admission, a
generation worker's lookups of the prompt blocks it already holds before a
transfer.
"""

from __future__ import annotations

from collections.abc import Iterator
from numbers import Real

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.planner_stats import IngressStats

PREFIX = "windserve"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)

# stats key -> (metric name, help, kind); counters get "_total" appended on exposition.
WORKER_SERIES = {
    "pages_in_use": (f"{PREFIX}_kv_pages_in_use", "KV cache pages bound to requests", "gauge"),
    "num_free_pages": (f"{PREFIX}_kv_pages_free", "KV cache pages free", "gauge"),
    "num_empty_pages": (f"{PREFIX}_kv_pages_empty", "KV cache pages free and holding no cached block", "gauge"),
    "kv_transfers": (f"{PREFIX}_kv_transfers", "KV pulls context -> generation, one per handoff", "counter"),
    "kv_transfer_bytes": (f"{PREFIX}_kv_transfer_bytes", "KV bytes moved context -> generation", "counter"),
    "kv_transfer_seconds": (f"{PREFIX}_kv_transfer_seconds", "Seconds spent moving KV", "counter"),
    "num_drafts_proposed": (f"{PREFIX}_spec_draft_tokens_proposed", "Draft tokens proposed", "counter"),
    "num_drafts_accepted": (f"{PREFIX}_spec_draft_tokens_accepted", "Draft tokens accepted", "counter"),
    "prefix_cache_queries": (f"{PREFIX}_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                             "counter"),
    "prefix_cache_hits": (f"{PREFIX}_prefix_cache_hits", "Prompt tokens found in the prefix cache", "counter"),
    "num_transfer_fallbacks": (f"{PREFIX}_kv_transfer_fallbacks",
                               "Prompts prefilled on a generation worker because their KV could not be pulled",
                               "counter"),
}
WORKER_LABELS = ("worker", "role")
# top-level stats key -> (metric name, help): the ingress's own counters ("_total" appended on exposition).
INGRESS_COUNTERS = {
    "context_fallbacks": (f"{PREFIX}_context_fallbacks",
                          "Prompts prefilled on a generation replica because no context replica answered"),
}


def _is_number(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


class WorkerStatsCollector(Collector):
    """Exposes the latest ``backend.stats()`` snapshot: per-worker series, and the ingress's counters."""

    def __init__(self) -> None:
        self._workers: list[dict] = []
        self._ingress: dict[str, Real] = {}

    def update(self, stats: dict | None) -> None:
        stats = stats or {}
        workers = stats.get("workers", [])
        self._workers = [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []
        self._ingress = {key: stats[key] for key in INGRESS_COUNTERS if _is_number(stats.get(key))}

    def collect(self) -> Iterator[Metric]:
        for key, value in self._ingress.items():
            name, documentation = INGRESS_COUNTERS[key]
            yield CounterMetricFamily(name, documentation, value=value)
        for key, (name, documentation, kind) in WORKER_SERIES.items():
            family_cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_cls(name, documentation, labels=WORKER_LABELS)
            for worker in self._workers:
                value = worker.get(key)
                if _is_number(value):
                    family.add_metric([str(worker.get("name", "")), str(worker.get("role", ""))], value)
            yield family


class ServingMetrics:
    """Every metric one app exposes; see the module docstring. ``slo_window``, if given, also gets each
    finished request's TTFT and TPOT: the windowed percentiles the P:D planner reads (app.planner_stats)."""

    def __init__(self, slo_window: IngressStats | None = None) -> None:
        self.slo_window = slo_window
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_http_requests", "HTTP requests by route and status",
            ["route", "status"], registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{PREFIX}_requests_in_flight", "Generation requests being served", registry=self.registry
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Arrival to first generated token",
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Mean gap between output tokens after the first",
            buckets=TPOT_BUCKETS, registry=self.registry,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens", registry=self.registry)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens", registry=self.registry
        )
        self.workers = WorkerStatsCollector()
        self.registry.register(self.workers)

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_finished(
        self, *, ttft_s: float | None, tpot_s: float | None, num_prompt_tokens: int, num_output_tokens: int
    ) -> None:
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
            if self.slo_window is not None:
                self.slo_window.on_finished(ttft_s, tpot_s)
        if tpot_s is not None:
            self.tpot.observe(tpot_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)

    def render(self, stats: dict | None) -> bytes:
        """Prometheus text exposition, with worker series from ``stats``."""
        self.workers.update(stats)
        return generate_latest(self.registry)
