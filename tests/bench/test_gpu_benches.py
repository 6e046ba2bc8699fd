"""The GPU benchmarks' dry runs on the CPU: bench.engine_cuda and bench.step_profile stay runnable
between GPU leases, and what they report is consistent (float32 outputs equal transformers')."""

from __future__ import annotations

import json

from bench import engine_cuda, step_profile


def test_engine_cuda_dry_run_measures_both_dtypes_and_float32_outputs_match(tmp_path):
    figures = engine_cuda.main(["--device", "cpu", "--out", str(tmp_path)])
    rows = figures["throughput"]
    assert [(r["dtype"], r["concurrency"]) for r in rows] == [("float32", 1), ("float32", 8), ("bfloat16", 1),
                                                              ("bfloat16", 8)]
    assert all(r["outputs_equal"] == "8/8" for r in rows if r["dtype"] == "float32")  # greedy, same weights
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 for r in rows)
    assert json.loads((tmp_path / "engine_cuda.json").read_text())["device"] == "cpu"


def test_step_profile_reports_decode_steps_and_where_they_go(tmp_path):
    report = step_profile.main(["--concurrency", "4", "--steps", "3", "--out", str(tmp_path)])
    assert report.startswith("windserve-tiny float32 on cpu, concurrency 4: median decode step")
    assert "aten::" in report and "engine/engine.py" in report  # torch's table and cProfile's
    assert (tmp_path / "step_profile_cpu.txt").read_text() == report
