"""The skip budget (tests/skip_budget.py) in an inner pytest run: a whole run over budget fails,
the same run within budget passes, and a narrowed run (``-k``, a path) is never checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.skip_budget import SKIP_BUDGET, SkipGroup, group_of, over_budget

ROOT = Path(__file__).resolve().parents[1]
INNER_TESTS = """
import pytest

@pytest.mark.parametrize("i", range(2))
def test_needs_a_gpu(i):
    pytest.skip("needs a CUDA GPU")

def test_runs():
    assert True
"""


def inner_run(tmp_path: Path, budget: int, *args: str) -> subprocess.CompletedProcess:
    """pytest in ``tmp_path`` with testpaths = ["suite"] and one group ("needs a CUDA GPU", ``budget``)."""
    (tmp_path / "pytest.ini").write_text('[pytest]\ntestpaths = suite\nmarkers =\n    slow: long\n')
    (tmp_path / "conftest.py").write_text(
        "from tests.skip_budget import SkipBudget, SkipGroup\n"
        "def pytest_configure(config):\n"
        f"    config.pluginmanager.register(SkipBudget((SkipGroup('cuda', 'CUDA', {budget}, 'no GPU'),)))\n")
    (tmp_path / "suite").mkdir(exist_ok=True)
    (tmp_path / "suite" / "test_inner.py").write_text(INNER_TESTS)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("budget,returncode", [(1, 1), (2, 0)])
def test_a_whole_run_fails_only_over_budget(tmp_path, budget, returncode):
    run = inner_run(tmp_path, budget, "-m", "not slow")
    assert run.returncode == returncode, run.stdout[-2000:]
    assert ("cuda: 2 skips, budget 1" in run.stdout) == (returncode == 1)


@pytest.mark.parametrize("narrowing", [["-k", "gpu"], ["suite/test_inner.py"], []], ids=["k", "path", "no-m"])
def test_a_narrowed_run_is_not_checked(tmp_path, narrowing):
    marks = [] if not narrowing else ["-m", "not slow"]
    run = inner_run(tmp_path, 0, *marks, *narrowing)
    assert run.returncode == 0 and "skip budget" not in run.stdout, run.stdout[-2000:]
    assert "2 skipped" in run.stdout


def test_reasons_fall_in_the_first_matching_group_or_unexpected():
    groups = (SkipGroup("a", "CUDA", 1, ""), SkipGroup("b", "GPU", 5, ""))
    assert [group_of(r, groups) for r in ("needs a CUDA GPU", "a GPU", "no compiler")] == ["a", "b", "unexpected"]
    assert over_budget(["needs a CUDA GPU", "a GPU", "a GPU"], groups) == []
    assert over_budget(["no compiler"], groups) == ["unexpected: 1 skips, budget 0 (e.g. ['no compiler'])"]


def test_the_stated_groups_name_the_suites_skip_reasons():
    """The real table's patterns match the reasons the tests give (test_cuda.py, test_model_parity.py)."""
    assert group_of("needs a CUDA GPU", SKIP_BUDGET) == "cuda"
    assert group_of("the mkl model: nothing packed, by design", SKIP_BUDGET) == "parity-layout"
    assert group_of("the native kernels did not build", SKIP_BUDGET) == "unexpected"
