"""The ingress's end-to-end latency window (app.planner_stats.IngressStats) and how the planner uses it
(app.planner.observe_ingress, app.planner_core): percentiles checked against numpy's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config

from app import planner_stats as keys
from app.planner import PDPlanner, observe_ingress
from app.planner_capacity import synthetic_table
from app.planner_core import Fleet, Observation, PlannerConfig, PlannerCore
from app.planner_stats import IngressStats, percentile
from bench.planner_contexts import RoleView, build_contexts, by_name

WINDOW = 10.0
latencies = st.floats(0.0, 60.0, allow_nan=False)
# (ended at, ttft, tpot or None for a one-token output)
requests = st.lists(st.tuples(st.floats(0.0, 30.0), latencies, st.none() | latencies), max_size=60)


@settings(max_examples=200, deadline=None)
@given(st.lists(latencies, min_size=1, max_size=50), st.floats(0.0, 100.0))
def test_percentile_is_numpys_linear_percentile(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(requests, st.floats(0.0, 40.0), st.floats(0.01, 5.0), st.floats(0.001, 1.0))
def test_the_window_reports_what_its_requests_give(reqs, now, ttft_slo, tpot_slo):
    stats = IngressStats(ttft_slo, tpot_slo, window_s=WINDOW)
    for ended, ttft, tpot in sorted(reqs, key=lambda r: r[0]):
        stats.on_finished(ttft, tpot, now=ended)
    report = stats.report(now=now)
    inside = [(ttft, tpot) for ended, ttft, tpot in reqs if now - WINDOW <= ended]  # a later one counts too
    ttfts, tpots = [t for t, _ in inside], [p for _, p in inside if p is not None]
    good = [1 for t, p in inside if t <= ttft_slo and (p is None or p <= tpot_slo)]
    assert report[keys.ING_FINISHED] == pytest.approx(len(inside) / WINDOW)
    assert report[keys.ING_GOOD] == pytest.approx(len(good) / WINDOW)
    for values, names in ((ttfts, (keys.ING_TTFT_P50, keys.ING_TTFT_P90, keys.ING_TTFT_MEAN)),
                          (tpots, (keys.ING_TPOT_P50, keys.ING_TPOT_P90, keys.ING_TPOT_MEAN))):
        if not values:  # nothing measured: no key, never a zero
            assert not set(names) & set(report)
            continue
        p50, p90, mean = (report[n] for n in names)
        assert p50 == pytest.approx(float(np.percentile(values, 50)))
        assert p90 == pytest.approx(float(np.percentile(values, 90)))
        assert mean == pytest.approx(float(np.mean(values)))
        assert min(values) <= p50 <= p90 <= max(values)


def test_a_served_request_reaches_the_window_through_the_apps_metrics():
    from app.metrics import ServingMetrics

    window = IngressStats(1.0, 0.05)
    metrics = ServingMetrics(window)
    metrics.observe_finished(ttft_s=0.5, tpot_s=0.04, num_prompt_tokens=10, num_output_tokens=5)
    metrics.observe_finished(ttft_s=2.0, tpot_s=None, num_prompt_tokens=10, num_output_tokens=1)
    metrics.observe_finished(ttft_s=None, tpot_s=None, num_prompt_tokens=10, num_output_tokens=0)  # no token
    report = window.report()
    assert report[keys.ING_FINISHED] * window.window_s == pytest.approx(2)
    assert report[keys.ING_GOOD] * window.window_s == pytest.approx(1)
    assert report[keys.ING_TPOT_MEAN] == pytest.approx(0.04)


INGRESS = {keys.ING_FINISHED: {"i0": 3.0, "i1": 1.0}, keys.ING_GOOD: {"i0": 1.5, "i1": 1.0},
           keys.ING_TTFT_MEAN: {"i0": 2.0, "i1": 1.0}, keys.ING_TTFT_P90: {"i0": 4.0, "i1": 2.0},
           keys.ING_TPOT_MEAN: {"i0": 0.1, "i1": 0.2}, keys.ING_TPOT_P90: {"i0": 0.3, "i1": 0.3}}


def test_ingress_replicas_combine_by_the_requests_each_finished_and_cold_roles_give_no_latency():
    fields = observe_ingress(INGRESS, is_context_warm=True, is_generation_warm=True)
    assert fields["slo_met_share"] == pytest.approx(2.5 / 4)
    assert fields["ingress_ttft_s"] == pytest.approx((3 * 2.0 + 1.0) / 4)
    assert fields["ingress_ttft_p90_s"] == pytest.approx((3 * 4.0 + 2.0) / 4)
    assert fields["ingress_tpot_s"] == pytest.approx((3 * 0.1 + 0.2) / 4)
    cold_context = observe_ingress(INGRESS, is_context_warm=False, is_generation_warm=True)
    assert "ingress_ttft_s" not in cold_context and "ingress_ttft_p90_s" not in cold_context
    assert cold_context["ingress_tpot_p90_s"] == pytest.approx(0.3)


def planner_views(ctx_running, ingress_metrics, ctx_prefill_s=0.1):
    ctx = {keys.CTX_REQUESTS: {r: 5.0 for r in ctx_running}, keys.CTX_PROMPT_TOKENS: {r: 5000.0 for r in ctx_running},
           keys.CTX_COMPUTED_TOKENS: {r: 5000.0 for r in ctx_running},
           keys.CTX_PREFILL_S: {r: ctx_prefill_s for r in ctx_running}}
    gen = {keys.GEN_FINISHED: {"g0": 5.0}, keys.GEN_OUTPUT_LEN: {"g0": 100.0}}
    return [RoleView("ContextWorker", len(ctx_running), ctx_running, ctx),
            RoleView("GenerationWorker", 1, ("g0",), gen), RoleView("Ingress", 1, ("i0",), ingress_metrics)]


def test_the_ttft_correction_follows_the_ingress_once_every_context_replica_is_warm():
    planner = PDPlanner(adjustment_interval_s=30.0)
    slow_clients = {keys.ING_FINISHED: {"i0": 5.0}, keys.ING_TTFT_MEAN: {"i0": 3.0}}  # the replicas say 0.1 s
    counts = by_name(planner(build_contexts(planner_views(("c0",), slow_clients), 0.0))[0])
    assert counts["Ingress"] == 1  # held where it is
    planner(build_contexts(planner_views(("c0", "c1"), slow_clients), 30.0))  # c1 cold: the ingress not read
    assert planner.core.correction["context"] < 1.0  # c0's own 0.1 s: faster than the table
    planner(build_contexts(planner_views(("c0", "c1"), slow_clients), 61.0))
    assert planner.core.correction["context"] > 1.0


def test_a_role_whose_clients_see_its_p90_miss_the_slo_is_not_shrunk():
    def run(tpot_p90: float | None) -> tuple[int, int, str]:
        core = PlannerCore(PlannerConfig(adjustment_interval_s=30.0), synthetic_table())
        quiet, fleet = Observation(1.0, 500.0, 0.0, 50.0, ingress_tpot_p90_s=tpot_p90), Fleet(4, 3, 4, 3)
        for now in (0.0, 30.0, 60.0):
            decision = core.decide(now, quiet, fleet)
        return decision.num_context, decision.num_generation, decision.reason

    assert run(None) == (1, 1, "sized")
    assert run(0.04) == (1, 1, "sized")
    # TPOT p90 0.2 s against a 0.05 s SLO: the generation role keeps its 3
    assert run(0.2) == (1, 3, "sized; generation not shrunk: TPOT p90 over its SLO")


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.sampled_from([vars(keys)[k] for k in vars(keys) if k.startswith(("CTX_", "GEN_", "ING_"))]),
                       st.dictionaries(st.sampled_from(["c0", "g0", "i0", "zz"]),
                                       st.floats(allow_nan=True) | st.integers(-3, 3)), max_size=8))
def test_any_ingress_and_worker_values_give_bounded_counts_and_a_held_ingress(raw_metrics):
    policy = _apply_app_level_autoscaling_config(PDPlanner(adjustment_interval_s=30.0))
    views = [RoleView("ContextWorker", 1, ("c0",), raw_metrics), RoleView("GenerationWorker", 1, ("g0",), raw_metrics),
             RoleView("Ingress", 1, ("i0",), raw_metrics)]
    for now in (0.0, 30.0, 60.0, 90.0):
        counts = by_name(policy(build_contexts(views, now))[0])
        assert counts["Ingress"] == 1
        assert 1 <= counts["ContextWorker"] <= 7 and 1 <= counts["GenerationWorker"] <= 7
        assert counts["ContextWorker"] + counts["GenerationWorker"] <= 8
        assert not math.isnan(counts["ContextWorker"])


def test_a_hit_rate_from_gauges_that_differ_in_their_last_digits_stays_within_0_and_1():
    """Serve averages each gauge over its look-back apart: computed tokens a hair above the prompt tokens
    (seen served: hit = -5.5e-7) is no hit, not a missing metric that holds the planner."""
    from app.planner import observe

    ctx = {keys.CTX_REQUESTS: {"c0": 2.0}, keys.CTX_PROMPT_TOKENS: {"c0": 3000.0},
           keys.CTX_COMPUTED_TOKENS: {"c0": 3000.0017}}
    assert observe(ctx, {}, set(), set()).prefix_hit_rate == 0.0
