"""The P:D planner (app.planner_core, app.planner) on synthetic contexts: properties, holds, Serve's wrapper."""

from __future__ import annotations

import math
from types import SimpleNamespace

from hypothesis import assume, given, settings
from hypothesis import strategies as st
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config

from app import planner_stats as keys
from app.planner import PDPlanner
from app.planner_capacity import synthetic_table
from app.planner_core import Fleet, Observation, PlannerConfig, PlannerCore
from bench.planner_contexts import RoleView, build_contexts, by_name

INTERVAL = 30.0
STEADY = Fleet(1, 1, 1, 1)
rates = st.floats(0.0, 200.0)
prompts = st.floats(1.0, 8000.0)
hits = st.floats(0.0, 0.95)
outputs = st.floats(1.0, 2000.0)


def first_decision(obs: Observation, config: PlannerConfig | None = None, fleet: Fleet = STEADY):
    """A fresh planner's first sizing: one interval gathers, the next one sizes."""
    core = PlannerCore(config or PlannerConfig(adjustment_interval_s=INTERVAL), synthetic_table())
    core.decide(0.0, obs, fleet)
    return core.decide(INTERVAL, obs, fleet)


@settings(max_examples=60, deadline=None)
@given(rates, rates, prompts, hits, outputs)
def test_more_requests_never_get_fewer_replicas(rate_a, rate_b, prompt, hit, output):
    low, high = sorted((rate_a, rate_b))
    small = first_decision(Observation(low, prompt, hit, output))
    large = first_decision(Observation(high, prompt, hit, output))
    assert small.num_context + small.num_generation <= large.num_context + large.num_generation
    if large.num_context + large.num_generation < 8:  # under the budget nothing is shared
        assert (small.num_context, small.num_generation) <= (large.num_context, large.num_generation)
        assert small.num_generation <= large.num_generation


@settings(max_examples=60, deadline=None)
@given(st.floats(0.1, 50.0), prompts, prompts, hits, outputs)
def test_longer_prompts_never_get_fewer_context_replicas_under_budget(rate, prompt_a, prompt_b, hit, output):
    """While both needs fit the budget. Over it (a prompt no number of replicas serves within the TTFT SLO
    needs the whole budget) the budget is shared by need, and a longer prompt's longer decode context may
    take a larger share (found by hypothesis: P 60 -> 59 at budget 64)."""
    short, long = sorted((prompt_a, prompt_b))
    config = PlannerConfig(adjustment_interval_s=INTERVAL, max_total_replicas=64)
    decisions = [first_decision(Observation(rate, prompt, hit, output), config) for prompt in (short, long)]
    assume(all(max(1, math.ceil(d.need_context)) + max(1, math.ceil(d.need_generation)) <= 64 for d in decisions))
    assert decisions[0].num_context <= decisions[1].num_context


@settings(max_examples=80, deadline=None)
@given(rates, prompts, hits, outputs, st.integers(2, 16), st.none() | st.integers(1, 8),
       st.none() | st.integers(1, 8))
def test_decisions_stay_within_every_bound(rate, prompt, hit, output, total, cap_p, cap_d):
    config = PlannerConfig(adjustment_interval_s=INTERVAL, max_total_replicas=total, max_context_replicas=cap_p,
                           max_generation_replicas=cap_d)
    decision = first_decision(Observation(rate, prompt, hit, output), config)
    assert 1 <= decision.num_context <= (cap_p or total)
    assert 1 <= decision.num_generation <= (cap_d or total)
    assert decision.num_context + decision.num_generation <= total


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["request_rate", "prompt_len", "output_len", "prefix_hit_rate"]),
       st.sampled_from([None, math.nan, -1.0, math.inf]))
def test_missing_metrics_hold_the_targets(field, bad):
    obs = Observation(40.0, 1500.0, 0.2, 130.0)._replace(**{field: bad})
    decision = first_decision(obs, fleet=Fleet(3, 2, 3, 2))
    assert (decision.num_context, decision.num_generation) == (3, 2)
    assert "missing" in decision.reason


def test_a_scale_up_still_loading_holds_until_it_runs():
    core = PlannerCore(PlannerConfig(adjustment_interval_s=INTERVAL), synthetic_table())
    busy = Observation(60.0, 1500.0, 0.2, 130.0)
    core.decide(0.0, busy, Fleet(1, 1, 1, 1))
    loading = core.decide(INTERVAL, busy, Fleet(1, 1, 3, 2))  # Serve still starts two replicas
    assert (loading.num_context, loading.num_generation, loading.reason) == (3, 2, "hold: scale-up still loading")
    sized = core.decide(2 * INTERVAL, busy, Fleet(3, 2, 3, 2))
    assert sized.reason == "sized" and sized.num_context + sized.num_generation > 5


def test_targets_stand_between_intervals_and_shrink_only_after_two_asks():
    core = PlannerCore(PlannerConfig(adjustment_interval_s=INTERVAL), synthetic_table())
    quiet, fleet = Observation(1.0, 500.0, 0.0, 50.0), Fleet(4, 3, 4, 3)
    core.decide(0.0, quiet, fleet)
    assert core.decide(10.0, quiet, fleet)[:2] == (4, 3)  # between intervals
    assert core.decide(INTERVAL, quiet, fleet)[:2] == (4, 3)  # first ask to shrink
    assert core.decide(2 * INTERVAL, quiet, fleet)[:2] == (1, 1)


def metrics(ttft_by_replica: dict[str, float], rate_each: float = 5.0) -> dict:
    return {keys.CTX_REQUESTS: {r: rate_each for r in ttft_by_replica},
            keys.CTX_PROMPT_TOKENS: {r: rate_each * 1000 for r in ttft_by_replica},
            keys.CTX_COMPUTED_TOKENS: {r: rate_each * 1000 for r in ttft_by_replica},
            keys.CTX_PREFILL_S: ttft_by_replica}


GEN = {keys.GEN_FINISHED: {"g0": 5.0}, keys.GEN_OUTPUT_LEN: {"g0": 100.0}}


def test_a_cold_replica_latency_is_ignored_for_its_first_interval():
    planner = PDPlanner(adjustment_interval_s=INTERVAL)

    def call(now: float, replicas: tuple[str, ...], ttft: dict[str, float]):
        views = [RoleView("ContextWorker", len(replicas), replicas, metrics(ttft)),
                 RoleView("GenerationWorker", 1, ("g0",), GEN)]
        return planner(build_contexts(views, now))

    call(0.0, ("c0",), {"c0": 0.1})
    call(INTERVAL, ("c0", "c1"), {"c0": 0.1, "c1": 30.0})  # c1 just started: its 30 s prefill is warm-up
    assert planner.core.correction["context"] < 1.0  # c0 alone: faster than the table expects
    call(2 * INTERVAL + 1, ("c0", "c1"), {"c0": 0.1, "c1": 30.0})  # c1 warm now: it counts
    assert planner.core.correction["context"] > 1.0


garbage = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=True) | st.text(max_size=3) | st.integers(),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                     max_size=3), max_leaves=8)


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.text(max_size=3), st.builds(
    SimpleNamespace, deployment_name=st.sampled_from(["ContextWorker", "GenerationWorker", "x"]),
    deployment_id=garbage, current_num_replicas=garbage, target_num_replicas=garbage,
    running_replicas=garbage, aggregated_metrics=garbage, current_time=garbage), max_size=3) | garbage)
def test_the_serve_call_never_raises_on_garbage(contexts):
    planner = PDPlanner(adjustment_interval_s=0.001)
    for _ in range(3):
        decisions, state = planner(contexts)
        assert isinstance(decisions, dict) and isinstance(state, dict)


@settings(max_examples=30, deadline=None)
@given(st.dictionaries(st.sampled_from(list(vars(keys)[k] for k in vars(keys) if k.startswith(("CTX_", "GEN_")))),
                       st.dictionaries(st.sampled_from(["c0", "g0", "zz"]), st.floats(allow_nan=True)), max_size=6))
def test_any_metric_values_give_bounded_counts_through_serve_wrapper(raw_metrics):
    policy = _apply_app_level_autoscaling_config(PDPlanner(adjustment_interval_s=INTERVAL))
    views = [RoleView("ContextWorker", 1, ("c0",), raw_metrics), RoleView("GenerationWorker", 1, ("g0",), raw_metrics)]
    for now in (0.0, INTERVAL, 2 * INTERVAL):
        decisions, _ = policy(build_contexts(views, now))
        counts = by_name(decisions)
        assert set(counts) == {"ContextWorker", "GenerationWorker"}
        assert all(1 <= n <= 7 for n in counts.values()) and sum(counts.values()) <= 8


def test_serve_wrapper_passes_a_sized_decision_through():
    policy = _apply_app_level_autoscaling_config(PDPlanner(adjustment_interval_s=INTERVAL))
    ctx = metrics({"c0": 0.2}, rate_each=30.0)
    gen = {keys.GEN_FINISHED: {"g0": 30.0}, keys.GEN_OUTPUT_LEN: {"g0": 100.0}}
    views = [RoleView("ContextWorker", 1, ("c0",), ctx), RoleView("GenerationWorker", 1, ("g0",), gen)]
    policy(build_contexts(views, 0.0))
    counts = by_name(policy(build_contexts(views, INTERVAL))[0])
    assert (counts["ContextWorker"], counts["GenerationWorker"]) == (4, 2)  # need 3.1 and 1.7


@settings(max_examples=60, deadline=None)
@given(rates, prompts, hits, outputs, st.integers(2, 12))
def test_fill_budget_serves_with_every_replica_and_meets_each_need_it_can(rate, prompt, hit, output, total):
    lean = first_decision(Observation(rate, prompt, hit, output),
                          PlannerConfig(adjustment_interval_s=INTERVAL, max_total_replicas=total))
    full = first_decision(Observation(rate, prompt, hit, output),
                          PlannerConfig(adjustment_interval_s=INTERVAL, max_total_replicas=total, fill_budget=True))
    assert full.num_context + full.num_generation == total
    if lean.num_context + lean.num_generation < total:  # both needs fit: neither role gets less
        assert full.num_context >= lean.num_context and full.num_generation >= lean.num_generation
