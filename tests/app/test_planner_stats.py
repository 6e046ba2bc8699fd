"""The workers' windowed gauges for the planner (app.planner_stats)."""

from __future__ import annotations

import pytest

from app import planner_stats as keys
from app.planner_stats import ContextStats, GenerationStats


def test_context_gauges_count_the_window_only_and_subtract_prefix_hits():
    stats = ContextStats(window_s=10.0)
    stats.on_prefill(1000, 0, 0.5, now=0.0)  # out of the window at t = 15
    stats.on_prefill(1000, 400, 0.2, now=8.0)
    stats.on_prefill(500, 0, 0.4, now=12.0)
    report = stats.report({"num_waiting": 3}, now=15.0)
    assert report[keys.CTX_REQUESTS] == pytest.approx(0.2)
    assert report[keys.CTX_PROMPT_TOKENS] == pytest.approx(150.0)
    assert report[keys.CTX_COMPUTED_TOKENS] == pytest.approx(110.0)
    assert report[keys.CTX_PREFILL_S] == pytest.approx(0.3)
    assert report[keys.CTX_WAITING] == 3


def test_no_prefill_means_no_latency_key_rather_than_a_zero():
    assert keys.CTX_PREFILL_S not in ContextStats().report({}, now=100.0)
    assert keys.GEN_TPOT_S not in GenerationStats().report({}, now=100.0)


def test_generation_gauges_time_tokens_after_the_first_update():
    stats = GenerationStats(window_s=10.0)
    stats.on_update(1, None, now=1.0)  # the stream's first update: nothing to time it against
    stats.on_update(1, 0.05, now=1.05)
    stats.on_update(3, 0.09, now=1.14)  # three drafts accepted in one step
    stats.on_finished(5, now=1.14)
    report = stats.report({"num_running": 2, "num_total_pages": 100, "num_free_pages": 60}, now=2.0)
    assert report[keys.GEN_TOKENS] == pytest.approx(0.5)
    assert report[keys.GEN_TPOT_S] == pytest.approx(0.14 / 4)
    assert report[keys.GEN_OUTPUT_LEN] == 5 and report[keys.GEN_FINISHED] == pytest.approx(0.1)
    assert (report[keys.GEN_RUNNING], report[keys.GEN_PAGES_IN_USE], report[keys.GEN_PAGES_TOTAL]) == (2, 40, 100)
