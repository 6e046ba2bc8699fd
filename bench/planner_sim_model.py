"""The replicas of the planner's simulator (bench.planner_sim): a context replica is a FIFO server,
a generation replica a continuous batch, both priced by the capacity table (app.planner_capacity).

    context replica      a prompt takes prefill_time(uncached prompt) after the prompts before it
    generation replica   every dt, each running stream gains dt / per_token_time(batch, mean context)
                         tokens; a stream is admitted when the batch is below the table's largest and
                         its whole KV (prompt + output) fits, and holds that KV until it ends
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from app.planner_capacity import CapacityTable
from app.planner_stats import ContextStats, GenerationStats
from bench.planner_traces import Request

TOKENS_PER_PAGE = 16  # only to report KV in pages, as a worker does


class Finished(NamedTuple):
    arrival_s: float
    ttft_s: float
    tpot_s: float


class ContextReplica:
    def __init__(self, name: str, ready_s: float) -> None:
        self.name, self.ready_s = name, ready_s
        self.free_at = ready_s
        self.is_draining = False
        self.ends: deque[float] = deque()  # when each assigned prompt's prefill ends, in order
        self.stats = ContextStats()

    def assign(self, request: Request, now: float, table: CapacityTable) -> float:
        """Queue a prompt; returns when its prefill ends (its first token)."""
        start = max(now, self.free_at)
        self.free_at = start + table.prefill_time(request.prompt_len - request.cached_len)
        self.ends.append(self.free_at)
        return self.free_at

    def num_ongoing(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            self.ends.popleft()
        return len(self.ends)

    def latest(self, now: float) -> dict:
        return {"num_waiting": max(0, self.num_ongoing(now) - 1), "queued_prefill_tokens": 0}

    def is_idle(self, now: float) -> bool:
        return self.num_ongoing(now) == 0


class GenerationReplica:
    def __init__(self, name: str, ready_s: float, table: CapacityTable) -> None:
        self.name, self.ready_s, self.table = name, ready_s, table
        self.is_draining = False
        self.stats = GenerationStats()
        # per running stream: tokens left, prompt length, output length, first token time, TTFT
        self.left = np.zeros(0)
        self.prompt = np.zeros(0)
        self.output = np.zeros(0)
        self.first_s = np.zeros(0)
        self.ttft = np.zeros(0)
        self.arrival = np.zeros(0)
        self.kv_tokens = 0.0  # reserved by the running streams: prompt + output each

    @property
    def num_running(self) -> int:
        return len(self.left)

    def can_admit(self, request: Request) -> bool:
        return (self.num_running < self.table.max_batch
                and self.kv_tokens + request.prompt_len + request.output_len <= self.table.kv_capacity_tokens)

    def admit(self, request: Request, first_s: float) -> None:
        def grow(array: np.ndarray, value: float) -> np.ndarray:
            return np.append(array, value)

        self.left = grow(self.left, request.output_len - 1)
        self.prompt, self.output = grow(self.prompt, request.prompt_len), grow(self.output, request.output_len)
        self.first_s, self.arrival = grow(self.first_s, first_s), grow(self.arrival, request.arrival_s)
        self.ttft = grow(self.ttft, first_s - request.arrival_s)
        self.kv_tokens += request.prompt_len + request.output_len

    def step(self, now: float, dt: float) -> list[Finished]:
        """Decode for ``dt`` seconds from ``now``; the streams that end in it."""
        if not self.num_running:
            return []
        context = float((self.prompt + self.output - self.left).mean())
        step_s = self.table.per_token_time(self.num_running, context)
        # a stream decodes from its first token on, not from the start of the step it was admitted in
        # (with short outputs a whole step's head start was most of their decode)
        decoding = np.clip(now + dt - np.maximum(self.first_s, now), 0.0, dt)
        gained = decoding / step_s
        self.stats.on_update(float(gained.sum()), float(decoding.sum()), now=now + dt)
        self.left = self.left - gained
        done = self.left <= 0
        if not done.any():
            return []
        end = now + dt + self.left[done] * step_s  # back to when the last token came
        decoded = np.maximum(self.output[done] - 1, 1)
        finished = [Finished(a, t, (e - f) / n) for a, t, e, f, n in
                    zip(self.arrival[done], self.ttft[done], end, self.first_s[done], decoded)]
        for n in self.output[done]:
            self.stats.on_finished(int(n), now=now + dt)
        self.kv_tokens -= float(self.prompt[done].sum() + self.output[done].sum())
        keep = ~done
        self.left, self.prompt, self.output = self.left[keep], self.prompt[keep], self.output[keep]
        self.first_s, self.ttft, self.arrival = self.first_s[keep], self.ttft[keep], self.arrival[keep]
        return finished

    def latest(self) -> dict:
        total = self.table.kv_capacity_tokens // TOKENS_PER_PAGE
        return {"num_running": self.num_running, "num_total_pages": total,
                "num_free_pages": total - int(self.kv_tokens // TOKENS_PER_PAGE)}
