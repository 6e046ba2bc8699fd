"""The GPU benchmarks' dry runs on the CPU: bench.engine_cuda and bench.step_profile stay runnable
between GPU leases, and what they report is consistent (float32 outputs equal transformers')."""

from __future__ import annotations

import json

import pytest

from bench import engine_cuda, step_profile
from bench.gpu_workload import SHAPES, TINY, WORKLOADS, nano_vllm_requests


def test_engine_cuda_dry_run_measures_both_dtypes_and_float32_outputs_match(tmp_path):
    figures = engine_cuda.main(["--device", "cpu", "--out", str(tmp_path)])
    rows = figures["throughput"]
    assert [(r["dtype"], r["concurrency"]) for r in rows] == [("float32", 1), ("float32", 8), ("bfloat16", 1),
                                                              ("bfloat16", 8)]
    assert all(r["outputs_equal"] == "8/8" for r in rows if r["dtype"] == "float32")  # greedy, same weights
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "engine_cuda.json").read_text())["device"] == "cpu"
    # the real shapes (shrunk): nano-vllm's workload served to every sequence's max_tokens, decode steps timed
    requests = nano_vllm_requests(**WORKLOADS["tiny"], vocab=TINY["vocab_size"])
    assert [r["model"] for r in figures["shapes"]] == list(SHAPES)
    for row in figures["shapes"]:
        assert row["sequences"] == len(requests)
        assert row["output_tokens"] == sum(params.max_tokens for _, params in requests)
        assert row["output_tok_s"] > 0 and row["decode_step_ms_batch_1"] > 0 and row["decode_step_ms_batch_2"] > 0


def test_step_profile_reports_decode_steps_and_where_they_go(tmp_path):
    report = step_profile.main(["--concurrency", "4", "--steps", "3", "--out", str(tmp_path)])
    assert report.startswith("windserve-tiny float32 on cpu, concurrency 4: median decode step")
    assert "aten::" in report and "engine/engine.py" in report  # torch's table and cProfile's
    assert (tmp_path / "step_profile_cpu.txt").read_text() == report


def test_busy_share_is_the_union_of_kernel_intervals_over_the_span():
    from bench.gpu_workload import busy_share

    assert busy_share([], 10.0) == 0.0
    assert busy_share([(0, 2), (1, 3), (5, 6)], 10.0) == pytest.approx(0.4)  # [0, 3) and [5, 6)
    assert busy_share([(4, 5), (0, 10), (2, 3)], 10.0) == pytest.approx(1.0)  # nested inside one
    assert busy_share([(0, 1)], 0.0) == 0.0
