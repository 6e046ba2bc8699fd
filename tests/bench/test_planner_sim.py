"""The planner's simulator (bench.planner_sim) on short traces: it runs the planner's own class, loses no
request to a scale-down, and the planner moves replicas to the side that needs them."""

from __future__ import annotations

from app.planner_capacity import synthetic_table
from bench.planner_policies import FixedPolicy, ServeDefaultRule
from bench.planner_sim import PlannerPolicy, Simulation
from bench.planner_traces import CODE, LONG_ANSWERS, poisson


def run(policy, shape, rate: float, duration_s: float = 240.0):
    trace = poisson(duration_s, lambda t: rate, lambda t, rng: shape, seed=1)
    sim = Simulation(trace, synthetic_table(), policy, duration_s)
    return sim, sim.run()


def test_prompt_heavy_traffic_gets_context_replicas_and_every_request_finishes():
    sim, result = run(PlannerPolicy(8, synthetic_table(), None), CODE, rate=24.0)
    assert len(sim.finished) == result.num_requests  # drained, none dropped
    assert result.mean_replicas[0] > result.mean_replicas[1]
    _, worst = run(FixedPolicy(2, 6), CODE, rate=24.0)
    assert result.goodput > 1.5 * worst.goodput


def test_generation_heavy_traffic_gets_generation_replicas():
    _, result = run(PlannerPolicy(8, synthetic_table(), None), LONG_ANSWERS, rate=14.0)
    assert result.mean_replicas[1] > result.mean_replicas[0]


def test_serve_default_rule_waits_out_its_delays():
    rule = ServeDefaultRule(target_ongoing=2.0, max_replicas=7, upscale_delay_s=30.0, downscale_delay_s=600.0)
    assert [rule.decide(t, 10.0, 1) for t in (0.0, 10.0, 20.0)] == [1, 1, 1]
    assert rule.decide(30.0, 10.0, 1) == 5
