"""What a worker replica tells the planner: windowed gauges for Serve's ``record_autoscaling_stats``.

Serve samples a deployment's ``record_autoscaling_stats()`` every few seconds, averages each
key per replica over its look-back window and hands the planner (app.planner) one number per
replica and key. The numbers here are built from events the replica's Serve methods already
see (a prefill's result and wall time, a stream's updates): the engine's step is not touched.

    context replica     requests/s, prompt tokens/s, computed (uncached) tokens/s, prefill
                        wall time (queue + compute), queued prefill tokens, waiting requests
    generation replica  output tokens/s, finished/s, mean output length, per-token time,
                        running streams, KV pages in use and in all
"""

from __future__ import annotations

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
