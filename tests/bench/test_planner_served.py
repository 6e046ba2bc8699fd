"""The planner served (bench.planner_served): its log line parser agrees with the planner's log line, and
(slow, excluded from CI) a whole scaling run on a multi-node Cluster meets the issue's targets."""

from __future__ import annotations

import logging

import pytest

from app.planner_capacity import synthetic_table
from app.planner_core import Fleet, Observation, PlannerConfig, PlannerCore
from bench import planner_served


def test_the_runs_parser_reads_the_planners_own_log_lines(tmp_path, caplog):
    core = PlannerCore(PlannerConfig(adjustment_interval_s=1.0), synthetic_table())
    obs = Observation(30.0, 1500.0, 0.1, 13.0, ingress_ttft_p90_s=0.4, num_warm_context=1, num_warm_generation=2)
    with caplog.at_level(logging.INFO, logger="ray.serve.planner"):
        core.decide(0.0, obs, Fleet(1, 2, 1, 2))
        decision = core.decide(1.0, obs, Fleet(1, 2, 1, 2))
    (record,) = [r for r in caplog.records if "planner:" in r.getMessage()]
    serve_log = tmp_path / "logs" / "serve"
    serve_log.mkdir(parents=True)
    (serve_log / "controller_1.log").write_text(f"INFO 2026-12-07 08:02:44,378 controller 1 -- {record.getMessage()}\n")
    (parsed,) = planner_served.planner_lines(str(tmp_path))
    assert (parsed["P"], parsed["D"], parsed["reason"]) == (decision.num_context, decision.num_generation,
                                                            decision.reason)
    assert (parsed["warm"], parsed["ingress_ttft_p90"], parsed["rate"]) == ("1/2", "0.4", "30")


@pytest.mark.slow
def test_a_served_run_moves_pd_with_the_load_and_loses_no_request_on_scale_down():
    result = planner_served.run(interval_s=8.0)
    assert all(check["within_two_intervals"] for check in result["direction"]), result["direction"]
    assert result["lost"] == 0, result["requests"]
    held = [r for r in result["removals"] if r["in_flight_during_removal"]]
    assert held, result["removals"]  # some removed replica was serving when the planner removed it
    assert all(r["in_flight_completed"] == r["in_flight_during_removal"] for r in result["removals"])
    assert result["cold"]["warm_count_above_running"] == 0
    assert result["nodes"] >= 3
