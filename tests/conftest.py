"""Session-wide setup, and the skip budget (tests/skip_budget.py) for a whole-suite run."""

from engine.native import paged_decode_kernel
from tests.skip_budget import SkipBudget


def pytest_configure(config) -> None:
    config.pluginmanager.register(SkipBudget(), "windserve-skip-budget")


def pytest_sessionstart(session) -> None:
    """Build the native kernel (~30 s the first time on this machine) before any test starts a worker:
    Ray actors and Serve replicas then load it from torch's extension cache instead of each compiling
    it inside a test's timeout."""
    paged_decode_kernel()
