"""The P:D planner's logic, without Ray: forecast the next interval, size both roles, hold when unsure.

Every ``adjustment_interval_s`` (between intervals the targets stand)::

    observation (rates, lengths, hit rate, measured TTFT / TPOT)   from the replicas (app.planner)
        │ forecast: Holt's linear exponential smoothing (level and trend, ``smoothing`` and
        │ ``trend_smoothing``) of the request rate, prompt length, prefix-hit rate and output
        │ length, one interval ahead; sizing takes the larger of the forecast and the latest rate
        ▼
    prefill: uncached prompt = prompt * (1 - hit); its prefill time t from the capacity table,
             times the TTFT correction; P = the fewest replicas whose expected TTFT, t plus an
             M/G/c queue's wait (PlannerConfig.expected_ttft), meets the SLO at the forecast rate
    decode:  context = prompt + output / 2 (a stream's mean KV over its life, as Dynamo's SLA
             planner takes it); the largest batch within TPOT SLO / correction whose KV fits
             gives one replica's tokens/s r_d, so        D = rate * output / r_d,
             and at least the streams running now over that batch (Little's law, measured)
        ▼
    bounds: at least 1 of each; per-role and total budgets (over budget: shared by need);
    a role shrinks only after ``scale_down_intervals`` intervals in a row asked for fewer.

Corrections are measured / expected latency (expected from the table at the measured load),
smoothed and clamped to ``correction_bounds``: a replica slower than its profile gets less
work. The caller (app.planner) leaves cold replicas out of the measured latency.
Holds (targets unchanged): a scale-up still loading, missing or non-finite metrics.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import NamedTuple

from app.planner_capacity import CapacityTable
from app.planner_forecast import Smoother

# A child of Serve's logger: in the controller, where the planner runs, Serve writes it to its own log
# (controller_*.log) at INFO; a logger of our own would fall to the root's WARNING there.
log = logging.getLogger("ray.serve.planner")
CORRECTION_MAX_LOAD = 0.7
KEEP_MARGIN = 0.5  # replicas a role must have beyond its need for a fill_budget split to be kept


@dataclass(frozen=True)
class PlannerConfig:
    adjustment_interval_s: float = 30.0
    ttft_slo_s: float = 1.0
    tpot_slo_s: float = 0.05
    max_total_replicas: int = 8
    max_context_replicas: int | None = None  # None: the total budget less one generation replica
    max_generation_replicas: int | None = None
    smoothing: float = 0.5  # weight of the newest interval in the forecast's level
    trend_smoothing: float = 0.3  # weight of the newest change in its trend (0: no trend, level only)
    max_utilization: float = 0.8  # a context replica's load is kept below this whatever the SLO allows
    prefill_cv2: float = 0.5  # squared coefficient of variation of prefill times (prompt lengths vary)
    correction_bounds: tuple[float, float] = (0.7, 2.0)  # a replica faster than profiled gains less than 1/0.7
    scale_down_intervals: int = 2
    fill_budget: bool = False  # True: every replica of the budget serves, split by need (goodput at a fixed
    # budget); False: only what the forecast needs (the rest is given back)
    capacity_path: str | None = None  # bench.profile's JSON; None: app.planner_capacity.synthetic_table
    context_deployment: str = "ContextWorker"
    generation_deployment: str = "GenerationWorker"
    ingress_deployment: str = "Ingress"  # its end-to-end TTFT / TPOT, where it reports them (app.planner)

    def __post_init__(self) -> None:
        if self.adjustment_interval_s <= 0 or self.ttft_slo_s <= 0 or self.tpot_slo_s <= 0:
            raise ValueError("interval and SLOs must be positive")
        if self.max_total_replicas < 2:
            raise ValueError("the budget must hold one replica of each role")
        for cap in (self.max_context_replicas, self.max_generation_replicas):
            if cap is not None and cap < 1:
                raise ValueError("a per-role budget must be at least 1")
        if not 0 <= self.trend_smoothing <= 1:
            raise ValueError("trend_smoothing in [0, 1]")
        if not 0 < self.smoothing <= 1 or not 0 < self.max_utilization < 1 or self.prefill_cv2 < 0:
            raise ValueError("smoothing in (0, 1], max_utilization in (0, 1), prefill_cv2 >= 0")

    def expected_ttft(self, prefill_s: float, arrivals_per_s: float, num_replicas: int) -> float:
        """Mean TTFT of ``num_replicas`` context replicas fed from one queue (the router sends a prompt
        where it starts first): the prefill plus an M/G/c wait by Sakasegawa's approximation,
        Wq = t * rho^(sqrt(2(c+1)) - 1) / (c (1 - rho)) * (1 + cv^2) / 2. Infinite at or past
        ``max_utilization``."""
        load = arrivals_per_s * prefill_s / num_replicas
        if load >= self.max_utilization:
            return math.inf
        wait = prefill_s * load ** (math.sqrt(2 * (num_replicas + 1)) - 1) / (num_replicas * (1 - load))
        return prefill_s + wait * (1 + self.prefill_cv2) / 2

    def role_caps(self) -> tuple[int, int]:
        total = self.max_total_replicas
        return (min(self.max_context_replicas or total - 1, total - 1),
                min(self.max_generation_replicas or total - 1, total - 1))


class Observation(NamedTuple):
    """One interval as the replicas measured it; None where nothing was measured."""

    request_rate: float | None  # requests/s reaching the context role
    prompt_len: float | None  # mean prompt tokens, cached part included
    prefix_hit_rate: float | None  # share of prompt tokens found cached
    output_len: float | None  # mean output tokens of finished requests
    ttft_s: float | None = None  # mean prefill latency of warm context replicas (queue + compute)
    tpot_s: float | None = None  # mean per-token time of warm generation replicas
    decode_batch: float | None = None  # mean running streams per warm generation replica
    backlog: float | None = None  # requests waiting at the context replicas: worked off within an interval
    decode_tokens_per_s: float | None = None  # output tokens/s of all generation replicas
    # the ingress's end-to-end latencies (app.planner_stats.IngressStats); None unless every running
    # replica of the role is warm (a cold replica's requests would be in them)
    ingress_ttft_s: float | None = None  # mean
    ingress_tpot_s: float | None = None  # mean
    ingress_ttft_p90_s: float | None = None
    ingress_tpot_p90_s: float | None = None
    slo_met_share: float | None = None  # of the requests that finished, those that met both SLOs
    num_warm_context: int | None = None  # running replicas past their first interval: whose latency counts
    num_warm_generation: int | None = None


class Fleet(NamedTuple):
    num_context: int  # running
    num_generation: int
    target_context: int  # what Serve is converging to
    target_generation: int

    @property
    def is_loading(self) -> bool:
        return self.num_context < self.target_context or self.num_generation < self.target_generation


class Decision(NamedTuple):
    num_context: int
    num_generation: int
    reason: str
    need_context: float = math.nan
    need_generation: float = math.nan


def _finite(*values: float | None) -> bool:
    return all(v is not None and math.isfinite(v) and v >= 0 for v in values)


class PlannerCore:
    """The planner's state between calls: forecasts, corrections, when it last adjusted."""

    def __init__(self, config: PlannerConfig, table: CapacityTable) -> None:
        self.config = config
        self.table = table
        self.forecasts = {key: Smoother(config.smoothing, config.trend_smoothing)
                          for key in ("rate", "prompt", "hit", "output")}
        self.correction = {"context": 1.0, "generation": 1.0}
        self.num_shrink_votes = {"context": 0, "generation": 0}
        self.last_adjusted_s: float | None = None

    def decide(self, now_s: float, obs: Observation, fleet: Fleet) -> Decision:
        """The targets for both roles; changes state only at an adjustment (once an interval)."""
        hold = Decision(max(1, fleet.target_context), max(1, fleet.target_generation), "between intervals")
        if self.last_adjusted_s is None:
            self.last_adjusted_s = now_s  # the first interval only gathers metrics
            return hold._replace(reason="first interval")
        if now_s - self.last_adjusted_s < self.config.adjustment_interval_s:
            return hold
        self.last_adjusted_s = now_s
        if fleet.is_loading:
            return self._logged(hold._replace(reason="hold: scale-up still loading"), obs)
        obs = self._filled(obs)
        if not _finite(obs.request_rate, obs.prompt_len, obs.prefix_hit_rate, obs.output_len):
            return self._logged(hold._replace(reason="hold: metrics missing"), obs)
        self._correct(obs, fleet)
        need_p, need_d = self._need(obs, fleet)
        num_p, num_d = self._fit(need_p, need_d)
        if self.config.fill_budget and abs(num_p - fleet.target_context) <= 1 and self._meets(need_p, need_d, fleet):
            # one replica off the ideal split but meeting both needs: moving it costs a replica's load time
            return self._logged(Decision(fleet.target_context, fleet.target_generation, "kept: meets both needs",
                                         need_p, need_d), obs)
        # a role whose clients see its latency miss the SLO (the ingress's p90) is not shrunk
        slow_p = _finite(obs.ingress_ttft_p90_s) and obs.ingress_ttft_p90_s > self.config.ttft_slo_s
        slow_d = _finite(obs.ingress_tpot_p90_s) and obs.ingress_tpot_p90_s > self.config.tpot_slo_s
        damped_p = self._damped("context", num_p, fleet.target_context, may_shrink=not slow_p)
        damped_d = self._damped("generation", num_d, fleet.target_generation, may_shrink=not slow_d)
        reason = "sized"
        if damped_p + damped_d <= self.config.max_total_replicas:  # else the budget wins over the damping
            reason += "".join(f"; {role} not shrunk: {what} p90 over its SLO" for role, what, slow, num, now in
                              (("context", "TTFT", slow_p, num_p, fleet.target_context),
                               ("generation", "TPOT", slow_d, num_d, fleet.target_generation)) if slow and num < now)
            num_p, num_d = damped_p, damped_d
        return self._logged(Decision(num_p, num_d, reason, need_p, need_d), obs)

    def _filled(self, obs: Observation) -> Observation:
        """Lengths missing from a quiet interval (nothing arrived or finished) taken from the forecast."""
        if not _finite(obs.request_rate):
            return obs
        levels = {"prompt_len": "prompt", "prefix_hit_rate": "hit", "output_len": "output"}
        return obs._replace(**{field: self.forecasts[key].level for field, key in levels.items()
                               if not _finite(getattr(obs, field))})

    def _need(self, obs: Observation, fleet: Fleet) -> tuple[float, float]:
        """Fractional replicas each role needs for the forecast; for decode, at least what the streams
        running now need (a length measured on finished streams lags when outputs grow: the long
        ones have not finished yet)."""
        f = self.forecasts
        # what arrives is served by completions: a queue that grew means more arrived than was counted
        backlog = obs.backlog / self.config.adjustment_interval_s if _finite(obs.backlog) else 0.0
        rate = max(f["rate"].update(obs.request_rate), obs.request_rate) + backlog
        prompt, hit = f["prompt"].update(obs.prompt_len), min(1.0, f["hit"].update(obs.prefix_hit_rate))
        output = f["output"].update(obs.output_len)
        uncached = max(1.0, prompt * (1 - min(hit, 1.0)))
        need_p = self._context_replicas(rate, self.table.prefill_time(uncached) * self.correction["context"])
        tpot_target = self.config.tpot_slo_s / self.correction["generation"]
        context = prompt + output / 2
        # the tokens decoded now count every running stream, not only those that finished
        decoded = obs.decode_tokens_per_s if _finite(obs.decode_tokens_per_s) else 0.0
        need_d = max(rate * max(output, 1.0), decoded) / self.table.decode_rate(tpot_target, context)
        if _finite(obs.decode_batch):
            running = obs.decode_batch * fleet.num_generation
            need_d = max(need_d, running / self.table.decode_batch_within(tpot_target, context))
        return need_p, need_d

    def _context_replicas(self, rate: float, prefill_s: float) -> float:
        """The fewest context replicas whose expected TTFT meets the SLO (the whole budget if none does)."""
        for num in range(1, self.config.max_total_replicas):
            if self.config.expected_ttft(prefill_s, rate, num) <= self.config.ttft_slo_s:
                return float(num)
        return float(self.config.max_total_replicas)

    def _correct(self, obs: Observation, fleet: Fleet) -> None:
        """Measured / expected latency, where both are there. Measured: the ingress's mean (what a client
        sees: the proxy, routing and the KV handoff included) where it reports one, else the warm
        replicas' own. Means, not percentiles: the model's expectation is a mean."""
        low, high = self.config.correction_bounds
        ttft = obs.ingress_ttft_s if _finite(obs.ingress_ttft_s) else obs.ttft_s
        tpot = obs.ingress_tpot_s if _finite(obs.ingress_tpot_s) else obs.tpot_s
        if _finite(ttft, obs.request_rate, obs.prompt_len, obs.prefix_hit_rate) and ttft > 0:
            uncached = max(1.0, obs.prompt_len * (1 - min(obs.prefix_hit_rate, 1.0)))
            prefill_s, num = self.table.prefill_time(uncached), max(1, fleet.num_context)
            if obs.request_rate * prefill_s / num < CORRECTION_MAX_LOAD:  # near saturation the wait is too steep
                self._blend("context", ttft / self.config.expected_ttft(prefill_s, obs.request_rate, num), low, high)
        if _finite(tpot, obs.decode_batch, obs.prompt_len, obs.output_len) and tpot > 0:
            expected = self.table.per_token_time(max(1.0, obs.decode_batch), obs.prompt_len + obs.output_len / 2)
            self._blend("generation", tpot / expected, low, high)

    def _blend(self, role: str, ratio: float, low: float, high: float) -> None:
        alpha = self.config.smoothing
        self.correction[role] = min(high, max(low, alpha * ratio + (1 - alpha) * self.correction[role]))

    def _fit(self, need_p: float, need_d: float) -> tuple[int, int]:
        """Whole replicas within the budgets. Over the total, it is shared in proportion to need; under
        it with ``fill_budget``, each role gets its need and half the spare (the context role the
        smaller half)."""
        cap_p, cap_d = self.config.role_caps()
        total = self.config.max_total_replicas
        want_p, want_d = min(cap_p, max(1, math.ceil(need_p))), min(cap_d, max(1, math.ceil(need_d)))
        if want_p + want_d <= total and not self.config.fill_budget:
            return want_p, want_d
        if want_p + want_d <= total:  # both needs met; the spare halved: headroom for a forecast miss either side
            split_p = want_p + (total - want_p - want_d) // 2
        else:
            split_p = round(total * need_p / (need_p + need_d))
        num_d = min(cap_d, max(1, total - min(cap_p, max(1, split_p))))
        return min(cap_p, max(1, total - num_d)), num_d

    def _meets(self, need_p: float, need_d: float, fleet: Fleet) -> bool:
        """The whole budget already serves, and each role has its need and half a replica to spare."""
        total = fleet.target_context + fleet.target_generation
        return (total == self.config.max_total_replicas and fleet.target_context >= need_p + KEEP_MARGIN
                and fleet.target_generation >= need_d + KEEP_MARGIN)

    def _damped(self, role: str, wanted: int, current: int, may_shrink: bool = True) -> int:
        """Grow at once; shrink only after ``scale_down_intervals`` intervals in a row asked to (and
        the ingress saw the role meet its SLO: ``may_shrink``)."""
        if wanted >= current or not may_shrink:
            self.num_shrink_votes[role] = 0
            return max(wanted, current)
        self.num_shrink_votes[role] += 1
        if self.num_shrink_votes[role] >= self.config.scale_down_intervals:
            self.num_shrink_votes[role] = 0
            return wanted
        return current

    def _logged(self, decision: Decision, obs: Observation) -> Decision:
        """One line a decision; bench.planner_served parses it (``name=value`` pairs, then the counts)."""
        log.info("planner: rate=%s prompt=%s hit=%s output=%s ttft=%s tpot=%s batch=%s backlog=%s decoded=%s "
                 "ingress_ttft=%s ingress_tpot=%s ingress_ttft_p90=%s ingress_tpot_p90=%s slo_met=%s "
                 "warm=%s/%s corr=%.2f/%.2f need=%.2f/%.2f -> P=%d D=%d (%s)", *(_fmt(v) for v in obs),
                 self.correction["context"], self.correction["generation"], decision.need_context,
                 decision.need_generation, decision.num_context, decision.num_generation, decision.reason)
        return decision


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"
