"""Session-wide setup, and the skip budget (tests/skip_budget.py) for a whole-suite run."""

import pytest

from engine.native import paged_decode_kernel
from tests.serving import stop_shared
from tests.skip_budget import SkipBudget


def pytest_configure(config) -> None:
    config.pluginmanager.register(SkipBudget(), "windserve-skip-budget")


def pytest_sessionstart(session) -> None:
    """Build the native kernel (~30 s the first time on this machine) before any test starts a worker:
    Ray actors and Serve replicas then load it from torch's extension cache instead of each compiling
    it inside a test's timeout."""
    paged_decode_kernel()


@pytest.fixture(autouse=True, scope="module")
def _no_shared_serve_unless_asked(request):
    """The shared Serve (tests.serving.shared_disagg_and_aggregated) lives only across modules that set
    ``SHARES_SERVE = True``; any other module starts without it (it may start its own Ray)."""
    if not getattr(request.module, "SHARES_SERVE", False):
        stop_shared()
    yield


def pytest_sessionfinish(session, exitstatus) -> None:
    stop_shared()
