"""The planner's simulator (bench.planner_sim) on short traces: it runs the planner's own class, loses no
request to a scale-down, and the planner moves replicas to the side that needs them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.planner_capacity import synthetic_table
from bench.planner_policies import FixedPolicy, ServeDefaultRule
from bench.planner_sim import DT_S, PlannerPolicy, Simulation
from bench.planner_sim_model import GenerationReplica
from bench.planner_traces import CODE, LONG_ANSWERS, Request, poisson


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


@settings(max_examples=40, deadline=None)
@given(st.floats(0.0, 0.199), st.integers(2, 200), st.integers(16, 4000))
def test_a_stream_decodes_from_its_first_token_not_from_its_steps_start(first_offset_s, output_len, prompt_len):
    """A simulated stream's TPOT is the table's step time whatever part of a 0.2 s step its first token
    came in (it once decoded from the step's start: short outputs got up to half their true TPOT)."""
    table = synthetic_table()
    replica = GenerationReplica("g0", 0.0, table)
    replica.admit(Request(0.0, prompt_len, 0, output_len), first_s=first_offset_s)
    finished, now = [], 0.0
    while not finished and now < 60.0:
        finished = replica.step(now, DT_S)
        now += DT_S
    (done,) = finished
    expected = table.per_token_time(1, prompt_len + output_len / 2)
    assert done.tpot_s == pytest.approx(expected, rel=0.02)
