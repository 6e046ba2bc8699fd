"""The suite's skip budget: how many skips ``.ci/run`` expects, by cause, stated once (``SKIP_BUDGET``).

A regression that turns passing tests into skips (a native build that broke, a layout that packs
nothing) shows up only as more skips; this check turns "more skips than expected" into a failure.
It runs only when the whole suite runs as README.md's command runs it (``python -m pytest -q -m
"not slow"`` from the repository root, which collects ``testpaths``): a ``-k``, a file or a node id
narrows the run, and then counts mean nothing, so nothing is checked.

Each skip's reason is matched against the groups' patterns in order; the first that matches
counts it, and a reason no group names counts against a budget of 0.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import pytest

UNEXPECTED = "unexpected"


@dataclass(frozen=True)
class SkipGroup:
    name: str
    pattern: str  # re.search against the skip's reason
    budget: int  # skips of this cause that a whole run under .ci/run may have
    why: str


SKIP_BUDGET: tuple[SkipGroup, ...] = (
    SkipGroup("cuda", r"needs a CUDA GPU", 27,
              "tests/engine/test_cuda.py (18) and test_cuda_graphs.py (9), marked gpu: CI has no GPU; "
              "bench/gpu_check.sh runs them on one"),
    SkipGroup("parity-layout", r"the mkl model: nothing packed", 6,
              "tests/engine/test_model_parity.py: one per architecture's unpacked (mkl) model, which packs "
              "nothing by design; an onednn model with nothing packed fails instead"),
)


def group_of(reason: str, groups: tuple[SkipGroup, ...]) -> str:
    return next((g.name for g in groups if re.search(g.pattern, reason)), UNEXPECTED)


def over_budget(reasons: list[str], groups: tuple[SkipGroup, ...]) -> list[str]:
    """One line per group with more skips than its budget (a reason no group names: budget 0)."""
    counts = Counter(group_of(reason, groups) for reason in reasons)
    budgets = {g.name: g.budget for g in groups}
    lines = []
    for name, count in sorted(counts.items()):
        if count > budgets.get(name, 0):
            examples = sorted({r for r in reasons if group_of(r, groups) == name})[:3]
            lines.append(f"{name}: {count} skips, budget {budgets.get(name, 0)} (e.g. {examples})")
    return lines


def is_whole_suite(config: pytest.Config) -> bool:
    """README.md's command: no paths (so ``testpaths``), no ``-k``, ``-m "not slow"``, nothing deselected."""
    return (config.args_source is pytest.Config.ArgsSource.TESTPATHS
            and not config.option.keyword
            and config.option.markexpr == "not slow"
            and not config.getoption("lf", False)
            and not config.getoption("deselect", None))


def skip_reason(report: pytest.TestReport) -> str | None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


class SkipBudget:
    """A pytest plugin: collects skip reasons, and fails a whole-suite session that exceeds ``groups``."""

    def __init__(self, groups: tuple[SkipGroup, ...] = SKIP_BUDGET) -> None:
        self.groups = groups
        self.reasons: list[str] = []
        self.problems: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        reason = skip_reason(report)
        if reason is not None:
            self.reasons.append(reason)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == pytest.ExitCode.INTERRUPTED or not is_whole_suite(session.config):
            return
        self.problems = over_budget(self.reasons, self.groups)
        if self.problems and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.problems:
            terminalreporter.section("skip budget exceeded (tests/skip_budget.py)", red=True)
            for line in self.problems:
                terminalreporter.line(line, red=True)
