"""bench.prefill_ab's smallest mode: the earlier revision's attention and this one's, alternated,
give the same tokens on prompts long enough for chunks after a prefix."""

from __future__ import annotations

import subprocess

import pytest

from bench import prefill_ab

REV = "d294006"


def _has_revision() -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{REV}^{{commit}}"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _has_revision(), reason=f"a shallow clone without {REV}")
def test_prefill_ab_quick_runs_both_and_tokens_are_identical(tmp_path):
    figures = prefill_ab.main(["--quick", "--rev", REV, "--out", str(tmp_path)])
    (row,) = figures["rows"]
    assert row["model"] == "windserve-tiny" and row["identical"]
    assert [len(v) for v in row["cpu_s"].values()] == [2, 2] and row["ratio"] > 0
