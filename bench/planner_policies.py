"""The planner's baselines in the simulator (bench.planner_sim): a fixed P:D, and Serve's default rule."""

from __future__ import annotations

import math
from collections import deque


class FixedPolicy:
    def __init__(self, num_context: int, num_generation: int) -> None:
        self.name = f"fixed {num_context}:{num_generation}"
        self.initial = (num_context, num_generation)

    def targets(self, sim, now: float) -> tuple[int, int]:
        return self.initial


class ServeDefaultRule:
    """ray.serve.autoscaling_policy's default for one deployment, with its default config:
    desired = ceil(mean ongoing requests over look_back_period_s / target_ongoing_requests),
    taken once the decision has pointed the same way for upscale_delay_s / downscale_delay_s."""

    def __init__(self, target_ongoing: float, max_replicas: int, look_back_s: float = 30.0,
                 upscale_delay_s: float = 30.0, downscale_delay_s: float = 600.0) -> None:
        self.target_ongoing, self.max_replicas = target_ongoing, max_replicas
        self.look_back_s, self.delays = look_back_s, (upscale_delay_s, downscale_delay_s)
        self.samples: deque[tuple[float, float]] = deque()
        self.since: tuple[int, float] | None = None  # (direction, when the decisions began pointing that way)

    def decide(self, now: float, ongoing: float, current: int) -> int:
        self.samples.append((now, ongoing))
        while self.samples[0][0] < now - self.look_back_s:
            self.samples.popleft()
        mean = sum(v for _, v in self.samples) / len(self.samples)
        desired = min(self.max_replicas, max(1, math.ceil(mean / self.target_ongoing)))
        direction = (desired > current) - (desired < current)
        if direction == 0:
            self.since = None
            return current
        if self.since is None or self.since[0] != direction:
            self.since = (direction, now)
        delay = self.delays[0] if direction > 0 else self.delays[1]
        if now - self.since[1] >= delay:
            self.since = None
            return desired
        return current


class ServeDefaultPolicy:
    """Each deployment scaled on its own by Serve's default rule; past the budget, a scale-up
    gets only the room left (the replicas beyond it would stay pending on the cluster)."""

    name = "serve-default"

    def __init__(self, budget: int, generation_target_ongoing: float) -> None:
        self.budget = budget
        self.initial = (budget // 2, budget - budget // 2)
        self.rules = (ServeDefaultRule(2.0, budget - 1), ServeDefaultRule(generation_target_ongoing, budget - 1))

    def targets(self, sim, now: float) -> tuple[int, int]:
        context_ongoing = sum(r.num_ongoing(now) for r in sim.context if not r.is_draining)
        generation_ongoing = sum(r.num_running for r in sim.generation if not r.is_draining) + len(sim.waiting)
        current = sim.target
        wanted = [rule.decide(now, ongoing, n) for rule, ongoing, n in
                  zip(self.rules, (context_ongoing, generation_ongoing), current)]
        for i in (0, 1):
            other = wanted[1 - i] if wanted[1 - i] <= current[1 - i] else current[1 - i]
            wanted[i] = min(wanted[i], max(current[i], self.budget - other))
        if sum(wanted) > self.budget:  # both grew at once: the first come (context) first
            wanted[1] = self.budget - wanted[0]
        return wanted[0], wanted[1]
