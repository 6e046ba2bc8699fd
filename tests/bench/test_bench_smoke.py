"""The benchmarks' smallest modes run end to end and write the figures they promise.

Each runs as a subprocess (``python -m bench.<name> --quick``) so Ray and
torch settings stay out of the test process. On an idle 2-core machine the
engine run takes ~25 s (so it runs in CI) and the transfer run ~50 s, most of
it starting Ray and five actors (so it is ``slow``); the timeouts leave room
for a loaded machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_bench(name: str, out_dir: str, timeout_s: float) -> dict:
    proc = subprocess.run([sys.executable, "-m", f"bench.{name}", "--quick", "--out", out_dir], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(os.path.join(out_dir, f"{name}.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert record["name"] == name and f"bench.{name}" in record["command"] and record["date"]
    assert record["machine"]["cpu_count"] >= 1 and record["machine"]["torch"]
    assert os.path.isfile(os.path.join(out_dir, f"{name}.png")) == HAS_MATPLOTLIB
    return record


def test_engine_bench_quick(tmp_path):
    record = run_bench("engine", str(tmp_path), timeout_s=120)
    rows = record["throughput"]
    assert {r["concurrency"] for r in rows} == {1, 8}
    assert all(r["ours_tok_s"] > 0 and r["hf_tok_s"] > 0 and r["ratio"] > 0 for r in rows)
    spec = record["speculative"][0]
    assert spec["identical_outputs"] is True
    assert spec["passes_per_token_draft"] <= spec["passes_per_token_plain"] == 1.0
    floor = record["decode_floor"][0]
    assert floor["step_ms"] > 0 and floor["floor_ms"] > 0 and floor["copy_bandwidth_gb_s"] > 0


@pytest.mark.slow
def test_transfer_bench_quick(tmp_path):
    record = run_bench("transfer", str(tmp_path), timeout_s=180)
    assert record["geometry"]["page_nbytes"] == 512 * 1024
    assert [r["prompt_len"] for r in record["sizes"]] == [1000, 2000]
    for row in record["sizes"]:
        assert row["bytes_moved"] == row["bytes_min"] and row["bytes_ratio"] == 1.0
        assert row["bytes_window_unaware"] > row["bytes_moved"]
        assert row["descriptors"] <= row["pages"]
        assert row["slice_gb_s"] > 0 and row["buffer_gb_s"] > 0 and row["memcpy_gb_s"] > 0
    assert record["sizes"][0]["fragmented_descriptors"] == record["sizes"][0]["fragmented_pages"]
    assert all(check["same"] for check in record["cross_check"])
