"""bench.spec_ab's smallest mode: both policies measured, every ratio recorded, outputs identical
(``speculative`` raises otherwise)."""

from __future__ import annotations

import json
import os

from bench import spec_ab


def test_spec_ab_quick_records_both_policies(tmp_path):
    figures = spec_ab.main(["--quick", "--out", str(tmp_path)])
    assert set(figures["wall_ratios"]) == {"current", "previous"}
    for by_case in figures["wall_ratios"].values():
        assert list(by_case) == ["windserve-tiny random"] and len(by_case["windserve-tiny random"]) == 1
        assert all(r > 0 for r in by_case["windserve-tiny random"])
    with open(os.path.join(tmp_path, "spec_ab.json"), encoding="utf-8") as f:
        assert json.load(f)["medians"] == figures["medians"]
