"""The P:D planner as Serve's application-level autoscaling policy (configs/autoscale.yaml).

    applications[].autoscaling_policy:
        policy_function: app.planner:PDPlanner
        policy_kwargs: {adjustment_interval_s: 30, ttft_slo_s: 1.0, ...}   (app.planner_core.PlannerConfig)

Serve instantiates the class once in its controller with ``policy_kwargs`` and calls it every
control loop (0.1-0.5 s) with an ``AutoscalingContext`` per deployment that has an
``autoscaling_config``; it applies min/max and the up/down delays (0 in our config: the planner
has its own hysteresis) to what we return. Here: the contexts -> an ``Observation`` and a
``Fleet`` (app.planner_core), the core's decision -> replica counts. The call never raises and
never blocks: whatever goes wrong, it returns the targets Serve already has (a hold).

Cold replicas: a replica's latency counts only after it has been running one adjustment
interval (its first requests pay for warm-up); its rates count at once (they are demand).

The ingress: where it has an autoscaling_config (configs/autoscale.yaml pins it at one replica),
Serve hands us its gauges too: end-to-end TTFT / TPOT percentiles and SLO counts
(app.planner_stats.IngressStats), read by ``observe_ingress``; its own count is held.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping

from app import planner_stats as keys
from app.planner_capacity import CapacityTable, synthetic_table
from app.planner_core import Fleet, Observation, PlannerConfig, PlannerCore

log = logging.getLogger(__name__)


class PDPlanner:
    """Sizes the context and generation deployments together (app.planner_core)."""

    def __init__(self, **policy_kwargs) -> None:
        self.config = PlannerConfig(**policy_kwargs)
        table = CapacityTable.load(self.config.capacity_path) if self.config.capacity_path else synthetic_table()
        self.core = PlannerCore(self.config, table)
        self.first_seen: dict[object, dict[object, float]] = {}  # deployment -> replica -> when it first ran

    def __call__(self, contexts: Mapping) -> tuple[dict, dict]:
        try:
            return self._plan(contexts)
        except Exception:  # the controller's loop must go on: hold
            log.warning("planner: holding, it failed on these contexts", exc_info=True)
            return _hold(contexts), {}

    def _plan(self, contexts: Mapping) -> tuple[dict, dict]:
        by_name = {ctx.deployment_name: (dep_id, ctx) for dep_id, ctx in contexts.items()}
        names = (self.config.context_deployment, self.config.generation_deployment)
        if not all(name in by_name for name in names):
            return _hold(contexts), {}
        (p_id, p_ctx), (d_id, d_ctx) = by_name[names[0]], by_name[names[1]]
        now = p_ctx.current_time if _is_number(p_ctx.current_time) else time.time()
        warm_p, warm_d = self._warm(p_ctx, now), self._warm(d_ctx, now)
        fleet = Fleet(int(p_ctx.current_num_replicas), int(d_ctx.current_num_replicas),
                      int(p_ctx.target_num_replicas), int(d_ctx.target_num_replicas))
        obs = observe(p_ctx.aggregated_metrics or {}, d_ctx.aggregated_metrics or {}, warm_p, warm_d)
        ingress = by_name.get(self.config.ingress_deployment)
        if ingress is not None:  # present where configs/autoscale.yaml pins the ingress with an autoscaling_config
            obs = obs._replace(**observe_ingress(ingress[1].aggregated_metrics or {},
                                                 warm_p >= set(p_ctx.running_replicas or ()),
                                                 warm_d >= set(d_ctx.running_replicas or ())))
        decision = self.core.decide(now, obs, fleet)
        decisions = _hold(contexts) | {p_id: decision.num_context, d_id: decision.num_generation}
        return decisions, {dep_id: {"planner_reason": decision.reason} for dep_id in decisions}

    def _warm(self, ctx, now: float) -> set:
        """The running replicas past their first interval; remembers new ones, forgets gone ones."""
        running = set(ctx.running_replicas or ())
        previous = self.first_seen.get(ctx.deployment_id, {})
        seen = self.first_seen[ctx.deployment_id] = {r: previous.get(r, now) for r in running}
        return {r for r, since in seen.items() if now - since >= self.config.adjustment_interval_s}


def _hold(contexts: Mapping) -> dict:
    try:
        return {dep_id: int(ctx.target_num_replicas) for dep_id, ctx in contexts.items()}
    except Exception:
        return {}  # nothing returned for a deployment: Serve keeps it as it is


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _values(metrics: Mapping, key: str, replicas: set | None = None) -> list[float]:
    per_replica = metrics.get(key) or {}
    return [float(v) for r, v in per_replica.items() if _is_number(v) and (replicas is None or r in replicas)]


def _total(metrics: Mapping, key: str) -> float | None:
    values = _values(metrics, key)
    return sum(values) if values else None


def _mean(metrics: Mapping, key: str, replicas: set) -> float | None:
    values = _values(metrics, key, replicas)
    return sum(values) / len(values) if values else None


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def observe(p_metrics: Mapping, d_metrics: Mapping, warm_p: set, warm_d: set) -> Observation:
    """The replicas' windowed gauges (app.planner_stats), as Serve aggregated them, summed (rates)
    over every replica and averaged (latencies) over warm ones."""
    rate = _total(p_metrics, keys.CTX_REQUESTS)
    prompt_tokens, computed = _total(p_metrics, keys.CTX_PROMPT_TOKENS), _total(p_metrics, keys.CTX_COMPUTED_TOKENS)
    # clamped: Serve averages the two gauges over its look-back apart, so equal ones can differ in the last digit
    hit = min(1.0, max(0.0, 1 - computed / prompt_tokens)) if prompt_tokens and computed is not None else None
    finished = {r: v for r, v in (d_metrics.get(keys.GEN_FINISHED) or {}).items() if _is_number(v)}
    lengths = d_metrics.get(keys.GEN_OUTPUT_LEN) or {}
    weighted = [(finished[r], float(v)) for r, v in lengths.items() if r in finished and _is_number(v)]
    output = _ratio(sum(w * v for w, v in weighted), sum(w for w, _ in weighted)) if weighted else None
    return Observation(
        request_rate=rate, prompt_len=_ratio(prompt_tokens, rate), prefix_hit_rate=hit, output_len=output,
        ttft_s=_mean(p_metrics, keys.CTX_PREFILL_S, warm_p), tpot_s=_mean(d_metrics, keys.GEN_TPOT_S, warm_d),
        decode_batch=_mean(d_metrics, keys.GEN_RUNNING, warm_d), backlog=_total(p_metrics, keys.CTX_WAITING),
        decode_tokens_per_s=_total(d_metrics, keys.GEN_TOKENS), num_warm_context=len(warm_p),
        num_warm_generation=len(warm_d))


def _weighted(metrics: Mapping, key: str, weights: Mapping) -> float | None:
    """``key`` over the ingress replicas, each weighted by the requests it finished (exact for one
    replica; for several, a percentile so combined is an estimate of the fleet's)."""
    pairs = [(weights[r], float(v)) for r, v in (metrics.get(key) or {}).items()
             if _is_number(v) and r in weights and weights[r] > 0]
    return _ratio(sum(w * v for w, v in pairs), sum(w for w, _ in pairs)) if pairs else None


def observe_ingress(metrics: Mapping, is_context_warm: bool, is_generation_warm: bool) -> dict:
    """The Observation fields the ingress's gauges give (app.planner_stats.IngressStats). A role's
    latencies only while every one of its running replicas is warm: the ingress cannot tell which
    replica served a request, and a cold one's first requests pay for its warm-up."""
    weights = {r: float(v) for r, v in (metrics.get(keys.ING_FINISHED) or {}).items() if _is_number(v)}
    finished, good = sum(weights.values()), _total(metrics, keys.ING_GOOD)
    fields = {"slo_met_share": _ratio(good, finished)}
    if is_context_warm:
        fields |= {"ingress_ttft_s": _weighted(metrics, keys.ING_TTFT_MEAN, weights),
                   "ingress_ttft_p90_s": _weighted(metrics, keys.ING_TTFT_P90, weights)}
    if is_generation_warm:
        fields |= {"ingress_tpot_s": _weighted(metrics, keys.ING_TPOT_MEAN, weights),
                   "ingress_tpot_p90_s": _weighted(metrics, keys.ING_TPOT_P90, weights)}
    return fields
