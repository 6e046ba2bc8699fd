"""bench.serve.local_prefill: its trace and the figures it draws from per-request results."""

from __future__ import annotations

from bench.serve.client import RequestResult
from bench.serve.local_prefill import length_figures, make_length_trace


def test_trace_has_unique_prompts_of_each_length():
    trace = make_length_trace((32, 128), reps=3, seed=0)
    assert sorted(len(s.prompt) for s in trace) == [32] * 3 + [128] * 3
    assert len({s.prompt for s in trace}) == 6  # no prefix-cache hits between them
    assert trace == make_length_trace((32, 128), reps=3, seed=0)


def test_figures_pick_the_longest_length_where_local_is_not_slower():
    trace = make_length_trace((32, 128, 512), reps=2, seed=1)
    ttft = {"local": {32: 0.05, 128: 0.08, 512: 0.30}, "disagg": {32: 0.09, 128: 0.09, 512: 0.20}}
    runs = {mode: ([RequestResult(s.index, False, ok=True, ttft_s=ttft[mode][len(s.prompt)]) for s in trace], 0.0)
            for mode in ttft}
    figures = length_figures(trace, runs, (32, 128, 512))
    assert figures["by_length"][32]["ttft_p50_ms"] == {"local": 50.0, "disagg": 90.0}
    assert figures["by_length"][512]["disagg_over_local"] < 1
    assert figures["longest_length_local_not_slower"] == 128
