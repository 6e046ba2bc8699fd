"""What a worker replica tells the planner: windowed gauges for Serve's ``record_autoscaling_stats``.

Serve samples a deployment's ``record_autoscaling_stats()`` every few seconds, averages each
key per replica over its look-back window and hands the planner (app.planner) one number per
replica and key. The numbers here are built from events the replica's Serve methods already
see (a prefill's result and wall time, a stream's updates): the engine's step is not touched.

    context replica     requests/s, prompt tokens/s, computed (uncached) tokens/s, prefill
                        wall time (queue + compute), queued prefill tokens, waiting requests
    generation replica  output tokens/s, finished/s, mean output length, per-token time,
                        running streams, KV pages in use and in all
    ingress replica     end-to-end TTFT and TPOT (p50, p90, mean) of the requests that finished
                        in the window, finished/s, and of those the ones that met both SLOs /s

The ingress reports too: it is a deployment with a pinned autoscaling_config (min = max = 1 in
configs/autoscale.yaml), only so that Serve samples its ``record_autoscaling_stats`` and hands the
numbers to the planner beside the workers'; the planner holds its replica count where it is.
"""

from __future__ import annotations

import math
import time
from collections import deque

WINDOW_S = 10.0  # long enough to hold a few requests at low load, short against a 30 s interval

CTX_REQUESTS = "ctx_requests_per_s"
CTX_PROMPT_TOKENS = "ctx_prompt_tokens_per_s"
CTX_COMPUTED_TOKENS = "ctx_computed_tokens_per_s"
CTX_PREFILL_S = "ctx_prefill_s"
CTX_QUEUED_TOKENS = "ctx_queued_prefill_tokens"
CTX_WAITING = "ctx_num_waiting"
GEN_TOKENS = "gen_decode_tokens_per_s"
GEN_FINISHED = "gen_finished_per_s"
GEN_OUTPUT_LEN = "gen_output_len"
GEN_TPOT_S = "gen_tpot_s"
GEN_RUNNING = "gen_num_running"
GEN_PAGES_IN_USE = "gen_kv_pages_in_use"
GEN_PAGES_TOTAL = "gen_kv_pages_total"
ING_TTFT_P50, ING_TTFT_P90, ING_TTFT_MEAN = "ingress_ttft_p50_s", "ingress_ttft_p90_s", "ingress_ttft_mean_s"
ING_TPOT_P50, ING_TPOT_P90, ING_TPOT_MEAN = "ingress_tpot_p50_s", "ingress_tpot_p90_s", "ingress_tpot_mean_s"
ING_FINISHED = "ingress_finished_per_s"
ING_GOOD = "ingress_slo_met_per_s"  # finished requests that met both the TTFT and the TPOT SLO


class WindowedEvents:
    """Events of the last ``window_s`` seconds, each a few named numbers; sums and rates over them."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._events: deque[tuple[float, dict[str, float]]] = deque()

    def record(self, now: float | None = None, **values: float) -> None:
        self._events.append((time.monotonic() if now is None else now, values))

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()

    def sums(self, now: float | None = None) -> tuple[int, dict[str, float]]:
        """How many events in the window, and each key's sum over them."""
        self._trim(time.monotonic() if now is None else now)
        totals: dict[str, float] = {}
        for _, values in self._events:
            for key, value in values.items():
                totals[key] = totals.get(key, 0.0) + value
        return len(self._events), totals


class ContextStats:
    """A context replica's prefills: one event per prefill call that returned."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.events = WindowedEvents(window_s)

    def on_prefill(self, num_prompt_tokens: int, num_cached_tokens: int, wall_s: float,
                   now: float | None = None) -> None:
        self.events.record(now, prompt=num_prompt_tokens, computed=max(0, num_prompt_tokens - num_cached_tokens),
                           wall=wall_s)

    def report(self, latest: dict, now: float | None = None) -> dict[str, float]:
        count, sums = self.events.sums(now)
        window = self.events.window_s
        stats = {CTX_REQUESTS: count / window, CTX_PROMPT_TOKENS: sums.get("prompt", 0.0) / window,
                 CTX_COMPUTED_TOKENS: sums.get("computed", 0.0) / window,
                 CTX_QUEUED_TOKENS: float(latest.get("queued_prefill_tokens", 0)),
                 CTX_WAITING: float(latest.get("num_waiting", 0))}
        if count:  # no prefill, no latency: a missing key, not a zero the planner would trust
            stats[CTX_PREFILL_S] = sums["wall"] / count
        return stats


class GenerationStats:
    """A generation replica's streams: an event per update (tokens, gap) and per finished stream."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.tokens = WindowedEvents(window_s)
        self.finished = WindowedEvents(window_s)

    def on_update(self, num_new_tokens: float, gap_s: float | None, now: float | None = None) -> None:
        """``gap_s``: since the stream's previous update (None for its first, which the prefill made).
        One event may stand for several streams' updates: then ``gap_s`` is the sum of their gaps."""
        if gap_s is None:
            self.tokens.record(now, tokens=num_new_tokens)
        else:
            self.tokens.record(now, tokens=num_new_tokens, timed_tokens=num_new_tokens, gap=gap_s)

    def on_finished(self, num_output_tokens: int, now: float | None = None) -> None:
        self.finished.record(now, output=num_output_tokens)

    def report(self, latest: dict, now: float | None = None) -> dict[str, float]:
        _, tokens = self.tokens.sums(now)
        num_finished, finished = self.finished.sums(now)
        window = self.tokens.window_s
        total = float(latest.get("num_total_pages", 0))
        stats = {GEN_TOKENS: tokens.get("tokens", 0.0) / window, GEN_FINISHED: num_finished / window,
                 GEN_RUNNING: float(latest.get("num_running", 0)), GEN_PAGES_TOTAL: total,
                 GEN_PAGES_IN_USE: total - float(latest.get("num_free_pages", total))}
        if tokens.get("timed_tokens"):
            stats[GEN_TPOT_S] = tokens["gap"] / tokens["timed_tokens"]
        if num_finished:
            stats[GEN_OUTPUT_LEN] = finished["output"] / num_finished
        return stats


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, interpolated linearly between the two nearest
    ranks (numpy's default method): rank ``(n - 1) * q / 100`` of the sorted values."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


class IngressStats:
    """An ingress replica's finished requests: end-to-end TTFT and TPOT as the client sees them.

    A request is recorded once it ends, if it produced a token (one that failed before its first
    token has no latency to report). A one-token output has no TPOT: it meets the TPOT SLO, and
    adds nothing to the TPOT percentiles."""

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, window_s: float = WINDOW_S) -> None:
        self.ttft_slo_s, self.tpot_slo_s, self.window_s = ttft_slo_s, tpot_slo_s, window_s
        self._requests: deque[tuple[float, float, float | None]] = deque()  # (ended, ttft, tpot or None)

    def on_finished(self, ttft_s: float, tpot_s: float | None, now: float | None = None) -> None:
        self._requests.append((time.monotonic() if now is None else now, ttft_s, tpot_s))

    def meets_slos(self, ttft_s: float, tpot_s: float | None) -> bool:
        return ttft_s <= self.ttft_slo_s and (tpot_s is None or tpot_s <= self.tpot_slo_s)

    def report(self, now: float | None = None) -> dict[str, float]:
        now = time.monotonic() if now is None else now
        while self._requests and self._requests[0][0] < now - self.window_s:
            self._requests.popleft()
        ttfts = [ttft for _, ttft, _ in self._requests]
        tpots = [tpot for _, _, tpot in self._requests if tpot is not None]
        good = sum(1 for _, ttft, tpot in self._requests if self.meets_slos(ttft, tpot))
        stats = {ING_FINISHED: len(ttfts) / self.window_s, ING_GOOD: good / self.window_s}
        for values, keys in ((ttfts, (ING_TTFT_P50, ING_TTFT_P90, ING_TTFT_MEAN)),
                             (tpots, (ING_TPOT_P50, ING_TPOT_P90, ING_TPOT_MEAN))):
            if values:  # nothing measured: missing keys, not zeros the planner would trust
                stats |= {keys[0]: percentile(values, 50), keys[1]: percentile(values, 90),
                          keys[2]: sum(values) / len(values)}
        return stats
