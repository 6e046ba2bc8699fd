"""The P:D planner against fixed ratios and Serve's per-deployment rule, in a discrete-time model.

    python -m bench.planner_sim [--budget 8] [--duration 600] [--warmup 0] [--capacity profile.json] [--traces a,b]

For each trace (bench.planner_traces: stationary, shifting, burst) and one replica budget, goodput
(requests/s that meet both the TTFT and the TPOT SLO) of: every fixed P:D with P + D = budget (the
best one reported), Serve's default queue-length autoscaling applied to each deployment on its own,
and the planner: app.planner's own PDPlanner class, called with Serve's AutoscalingContext objects
built here (bench.planner_contexts) from the replicas' own gauges (app.planner_stats); once with
``fill_budget`` (the whole budget serves, split by need) and once sizing to need only.

Model and its assumptions:
- replicas (bench.planner_sim_model) run exactly as the capacity table says (the synthetic one
  unless ``--capacity``); no warm-up slowdown, no network: a prompt's first token is its TTFT and
  its KV reaches a generation replica at once; a stream reserves its whole KV when admitted.
- routing: a prompt to the context replica that frees first, a stream to the generation
  replica with the least KV in use (FIFO across replicas: the head waits for room).
- time advances in ``DT_S`` steps; the policy is asked every ``CONTROL_S`` (Serve's loop);
  a new replica serves ``LOAD_S`` after it was asked for; a removed one drains (takes nothing
  new, finishes what it holds) and stops counting against the budget at once.
- Serve's default rule per deployment (ray.serve.autoscaling_policy): desired =
  ongoing requests averaged over ``look_back_period_s`` (30 s) / ``target_ongoing_requests``,
  applied after ``upscale_delay_s`` (30 s) / ``downscale_delay_s`` (600 s) of agreeing decisions.
  Targets: the context's Serve default (2); the generation's the batch the table allows within
  the TPOT SLO at the stationary trace's mean context (an operator who tuned it). Replicas past
  the budget stay pending, as on a cluster that has room for ``budget`` replicas.
- both autoscaled policies start at budget / 2 of each role (``--warmup`` replays the trace's
  start first, unscored, so that they start settled); a request unfinished ``TAIL_S`` after
  the trace ends misses its SLO.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
from typing import NamedTuple

from app.planner import PDPlanner
from app.planner_capacity import CapacityTable, synthetic_table
from bench.planner_contexts import RoleView, build_contexts, by_name
from bench.planner_policies import FixedPolicy, ServeDefaultPolicy
from bench.planner_sim_model import ContextReplica, Finished, GenerationReplica
from bench.planner_traces import TRACES, Request

DT_S, CONTROL_S, LOAD_S, TAIL_S = 0.2, 1.0, 30.0, 120.0
TTFT_SLO_S, TPOT_SLO_S = 1.0, 0.05


class Result(NamedTuple):
    goodput: float  # requests/s meeting both SLOs, over the trace's duration
    num_requests: int
    num_good: int
    mean_replicas: tuple[float, float]


class PlannerPolicy:
    """app.planner.PDPlanner, fed contexts built from the simulated replicas."""

    def __init__(self, budget: int, table: CapacityTable, capacity_path: str | None, fill_budget: bool = True) -> None:
        self.budget = budget
        self.name = "planner" if fill_budget else "planner (need only)"
        self.planner = PDPlanner(max_total_replicas=budget, ttft_slo_s=TTFT_SLO_S, tpot_slo_s=TPOT_SLO_S,
                                 capacity_path=capacity_path, fill_budget=fill_budget)
        self.initial = (budget // 2, budget - budget // 2)

    def targets(self, sim: Simulation, now: float) -> tuple[int, int]:
        p_metrics, d_metrics = _metrics(sim.context, now), _metrics(sim.generation, now)
        views = [RoleView("ContextWorker", sim.target[0], _ready(sim.context, now), p_metrics),
                 RoleView("GenerationWorker", sim.target[1], _ready(sim.generation, now), d_metrics)]
        counts = by_name(self.planner(build_contexts(views, now, self.budget - 1))[0])
        return counts["ContextWorker"], counts["GenerationWorker"]


def _ready(replicas: list, now: float) -> tuple[str, ...]:
    return tuple(r.name for r in replicas if r.ready_s <= now and not r.is_draining)


def _metrics(replicas: list, now: float) -> dict[str, dict[str, float]]:
    metrics: dict[str, dict[str, float]] = {}
    for replica in replicas:
        if replica.ready_s <= now and not replica.is_draining:
            latest = replica.latest(now) if isinstance(replica, ContextReplica) else replica.latest()
            for key, value in replica.stats.report(latest, now).items():
                metrics.setdefault(key, {})[replica.name] = value
    return metrics


class Simulation:
    def __init__(self, trace: list[Request], table: CapacityTable, policy, duration_s: float,
                 warmup_s: float = 0.0) -> None:
        """``trace`` spans ``warmup_s + duration_s``; requests arriving in the warm-up are served, not scored."""
        self.trace, self.table, self.policy, self.duration_s = trace, table, policy, duration_s
        self.warmup_s = warmup_s
        self.names = itertools.count()
        self.context: list[ContextReplica] = []
        self.generation: list[GenerationReplica] = []
        self.target = (0, 0)
        self.prefilled: list[tuple] = []  # heap of (first token time, tie-break, request, its context replica)
        self.waiting: list[tuple[Request, float]] = []  # prefilled, no generation replica had room yet
        self.finished: list[Finished] = []
        self.replica_seconds = [0.0, 0.0]
        self._scale(policy.initial, 0.0, ready_s=0.0)

    def _scale(self, target: tuple[int, int], now: float, ready_s: float) -> None:
        self.target = target
        for replicas, wanted, make in ((self.context, target[0], lambda n: ContextReplica(n, ready_s)),
                                       (self.generation, target[1], lambda n: GenerationReplica(n, ready_s,
                                                                                                self.table))):
            active = [r for r in replicas if not r.is_draining]
            for _ in range(wanted - len(active)):
                replicas.append(make(f"r{next(self.names)}"))
            # loading ones go first, then the least busy: each drains what it holds
            surplus = max(0, len(active) - wanted)
            for replica in sorted(active, key=lambda r: (r.ready_s <= now, _work(r, now)))[:surplus]:
                replica.is_draining = True

    def run(self) -> Result:
        arrivals, now, end = iter(self.trace), 0.0, self.warmup_s + self.duration_s + TAIL_S
        upcoming = next(arrivals, None)
        while now < end and (upcoming is not None or self.prefilled or self.waiting or self._busy()):
            while upcoming is not None and upcoming.arrival_s < now + DT_S:
                self._arrive(upcoming)
                upcoming = next(arrivals, None)
            self._hand_over(now + DT_S)
            for replica in self.generation:
                self.finished.extend(replica.step(now, DT_S))
            now += DT_S
            if round(now / DT_S) % round(CONTROL_S / DT_S) == 0:
                self._control(now)
        scored = [f for f in self.finished if f.arrival_s >= self.warmup_s]
        good = sum(1 for f in scored if f.ttft_s <= TTFT_SLO_S and f.tpot_s <= TPOT_SLO_S)
        mean = tuple(s / max(now, DT_S) for s in self.replica_seconds)
        num_scored = sum(1 for r in self.trace if r.arrival_s >= self.warmup_s)
        return Result(good / self.duration_s, num_scored, good, mean)

    def _busy(self) -> bool:
        return any(r.num_running for r in self.generation)

    def _arrive(self, request: Request) -> None:
        ready = [r for r in self.context if not r.is_draining and r.ready_s <= request.arrival_s] or \
            [r for r in self.context if not r.is_draining]
        replica = min(ready, key=lambda r: r.free_at)
        first = replica.assign(request, request.arrival_s, self.table)
        heapq.heappush(self.prefilled, (first, id(request), request, replica))

    def _hand_over(self, until: float) -> None:
        while self.prefilled and self.prefilled[0][0] <= until:
            first, _, request, replica = heapq.heappop(self.prefilled)
            replica.stats.on_prefill(request.prompt_len, request.cached_len, first - request.arrival_s, now=first)
            if request.output_len <= 1:
                self.finished.append(Finished(request.arrival_s, first - request.arrival_s, 0.0))
            else:
                self.waiting.append((request, first))
        while self.waiting:
            request, first = self.waiting[0]
            room = [r for r in self.generation if not r.is_draining and r.ready_s <= until and r.can_admit(request)]
            if not room:
                return
            min(room, key=lambda r: r.kv_tokens).admit(request, first)
            self.waiting.pop(0)

    def _control(self, now: float) -> None:
        self.context = [r for r in self.context if not (r.is_draining and r.is_idle(now))]
        self.generation = [r for r in self.generation if not (r.is_draining and r.num_running == 0)]
        for i, replicas in enumerate((self.context, self.generation)):
            self.replica_seconds[i] += CONTROL_S * sum(1 for r in replicas if not r.is_draining)
        target = self.policy.targets(self, now)
        if target != self.target:
            self._scale(target, now, ready_s=now + LOAD_S)


def _work(replica, now: float) -> float:
    return replica.num_ongoing(now) if isinstance(replica, ContextReplica) else replica.num_running


def with_warmup(trace: list[Request], warmup_s: float) -> list[Request]:
    """The trace's first ``warmup_s`` replayed before it (the autoscaled policies settle on the traffic
    the scored part starts with, as a planner that was already running would have)."""
    head = [r for r in trace if r.arrival_s < warmup_s]
    return head + [r._replace(arrival_s=r.arrival_s + warmup_s) for r in trace]


def compare(trace_name: str, budget: int, duration_s: float, capacity_path: str | None,
            warmup_s: float = 0.0) -> dict[str, Result]:
    table = CapacityTable.load(capacity_path) if capacity_path else synthetic_table()
    trace = with_warmup(TRACES[trace_name](duration_s), warmup_s)

    def run(policy) -> Result:
        return Simulation(trace, table, policy, duration_s, warmup_s).run()

    results = {f"fixed {p}:{budget - p}": run(FixedPolicy(p, budget - p)) for p in range(1, budget)}
    target_d = table.decode_batch_within(TPOT_SLO_S, 1020 + 129 / 2)
    for policy in (ServeDefaultPolicy(budget, target_d), PlannerPolicy(budget, table, capacity_path),
                   PlannerPolicy(budget, table, capacity_path, fill_budget=False)):
        results[policy.name] = run(policy)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--capacity", default=None, help="bench.profile's JSON (default: the synthetic table)")
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--warmup", type=float, default=0.0, help="seconds of the trace's start replayed, unscored")
    args = parser.parse_args()
    logging.getLogger("ray.serve.planner").setLevel(logging.WARNING)  # one line a decision: too many here
    print(f"budget {args.budget}, {args.duration:.0f} s a trace after {args.warmup:.0f} s of warm-up, "
          f"SLOs TTFT {TTFT_SLO_S} s / TPOT {TPOT_SLO_S} s")
    print("| trace | best fixed | goodput | Serve per-deployment | goodput | planner | goodput | "
          "planner/fixed | planner/Serve | planner, need only | goodput |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.traces.split(","):
        results = compare(name, args.budget, args.duration, args.capacity, args.warmup)
        fixed = max((k for k in results if k.startswith("fixed")), key=lambda k: results[k].goodput)
        serve, planner, lean = results["serve-default"], results["planner"], results["planner (need only)"]
        print(f"| {name} | {fixed} | {results[fixed].goodput:.2f} | mean {_mean(serve)} | {serve.goodput:.2f} | "
              f"mean {_mean(planner)} | {planner.goodput:.2f} | {_ratio(planner, results[fixed])} | "
              f"{_ratio(planner, serve)} | mean {_mean(lean)} | {lean.goodput:.2f} |")


def _mean(result: Result) -> str:
    return f"{result.mean_replicas[0]:.1f}:{result.mean_replicas[1]:.1f}"


def _ratio(a: Result, b: Result) -> str:
    return f"{a.goodput / b.goodput:.2f}x" if b.goodput > 0 else ("inf" if a.goodput > 0 else "-")


if __name__ == "__main__":
    main()

