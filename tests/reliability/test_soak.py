"""A bounded mixed load (bench.soak): streams, client cancellations, disconnects,
long and short prompts. At the end: nothing hung or failed, zero pages in use on
every worker, and worker RSS flat within RSS_BOUND_KIB of its post-warm-up value.

    CI:    ~60 s (10 s warm-up + 45 s load + settling)
    slow:  WINDSERVE_SOAK_MINUTES (default 5) of load, ``pytest -m slow``
"""

from __future__ import annotations

import asyncio
import os

import pytest

from bench.soak import SoakResult, soak
from tests.reliability.conftest import (
    API_KEY,
    LEASE_S,
    Service,
    pages_in_use,
    record,
    wait_pages_free,
    wait_serving,
    worker_rss_kib,
)

WARM_UP_S = 10.0
RSS_BOUND_KIB = 64 * 1024  # a leak of one page table or request per request would pass this within minutes


def run_soak(service: Service, name: str, seconds: float) -> None:
    assert wait_serving(service)
    asyncio.run(soak(service.url, API_KEY, WARM_UP_S, concurrency=6))  # lazy allocations land before the baseline
    assert wait_pages_free(service, timeout_s=LEASE_S + 10) is not None, pages_in_use(service)
    before = worker_rss_kib()
    result: SoakResult = asyncio.run(soak(service.url, API_KEY, seconds, concurrency=6, seed=1))
    free_s = wait_pages_free(service, timeout_s=LEASE_S + 10)
    after = worker_rss_kib()
    growth = {actor: after[actor] - before[actor] for actor in before if actor in after}
    record(name, requests=result.num_requests, outcomes=dict(sorted(result.outcomes.items())),
           max_latency_s=round(result.max_latency_s, 2), pages_free_after_s=free_s,
           rss_growth_kib=growth, rss_after_kib=after)
    assert result.count("hung") == 0 and result.count("failed") == 0, result.outcomes
    assert result.count("ok") > 0 and result.count("cancelled") > 0
    assert free_s is not None, pages_in_use(service)
    assert set(growth) == set(before) and len(before) == 2, (before, after)  # the same two replicas throughout
    assert all(kib < RSS_BOUND_KIB for kib in growth.values()), growth


def test_soak_short(service: Service):
    run_soak(service, "soak_ci", seconds=45)


@pytest.mark.slow
def test_soak_long(service: Service):
    run_soak(service, "soak_long", seconds=60 * float(os.environ.get("WINDSERVE_SOAK_MINUTES", "5")))
