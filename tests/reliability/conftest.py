"""One real Ray + Serve for the whole package: a disaggregated windserve on 127.0.0.1.

    /rel   ContextWorker + GenerationWorker over NIXL, 8-token pages, a small
           page pool (48 pages per layer group), 3 s leases, an API key and
           max_queue=16: the configuration the fault, overload, fuzz and soak
           tests push on.

Tests in this package may kill replicas; ``wait_serving`` waits until the
application answers again before a test starts.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from app.serve_app import build_app
from tests.serving import serving

MODEL = "windserve-tiny"
API_KEY = "reliability-key"
APP_NAME = "rel"
NUM_PAGES = 48
TOKENS_PER_BLOCK = 8
MAX_QUEUE = 16
LEASE_S = 3.0
CONFIG = {"mode": "disagg", "model": MODEL, "tokens_per_block": TOKENS_PER_BLOCK, "num_pages": NUM_PAGES,
          "max_num_seqs": 8, "max_num_batched_tokens": 64, "device": "cpu", "lease_s": LEASE_S,
          "api_key": API_KEY, "max_queue": MAX_QUEUE}
MAX_MODEL_LEN = NUM_PAGES * TOKENS_PER_BLOCK
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@dataclass(frozen=True)
class Service:
    url: str  # the application's root, e.g. http://127.0.0.1:PORT/rel

    def client(self, timeout_s: float = 30.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=AUTH, timeout=timeout_s)

    def async_client(self, timeout_s: float = 30.0, **limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=timeout_s,
                                 limits=httpx.Limits(**limits) if limits else httpx.Limits())


@pytest.fixture(scope="package")
def service() -> Iterator[Service]:
    with serving({APP_NAME: build_app(CONFIG)}) as base:
        live = Service(f"{base}/{APP_NAME}")
        assert wait_serving(live, timeout_s=120), "the application never answered"
        yield live


def wait_until(predicate: Callable[[], bool], timeout_s: float, period_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except (httpx.HTTPError, ValueError):
            pass  # the service is coming back
        time.sleep(period_s)
    return False


def completes(live: Service, max_tokens: int = 4) -> bool:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    with live.client(timeout_s=20) as http:
        reply = http.post("/v1/completions", json=body)
    return reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == max_tokens


def wait_serving(live: Service, timeout_s: float = 60) -> bool:
    """Until a request completes and both worker roles report their pages."""
    return wait_until(lambda: completes(live) and roles_reporting(live) >= {"context", "generation"}, timeout_s, 0.5)


def metric_samples(live: Service, name: str) -> dict[tuple[str, str], float]:
    """(worker, role) -> value of one worker series in /metrics."""
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    return {(s.labels["worker"], s.labels["role"]): s.value
            for family in text_string_to_metric_families(text) for s in family.samples if s.name == name}


def roles_reporting(live: Service) -> set[str]:
    return {role for _, role in metric_samples(live, "windserve_kv_pages_in_use")}


def pages_in_use(live: Service) -> dict[tuple[str, str], float]:
    return metric_samples(live, "windserve_kv_pages_in_use")


def pages_all_free(live: Service) -> bool:
    in_use = pages_in_use(live)
    return roles_reporting(live) >= {"context", "generation"} and all(v == 0 for v in in_use.values())


def wait_pages_free(live: Service, timeout_s: float = 15) -> float | None:
    """Seconds until every worker reports zero pages in use; None if that never happened."""
    start = time.monotonic()
    if wait_until(lambda: pages_all_free(live), timeout_s):
        return time.monotonic() - start
    return None


@dataclass(frozen=True)
class ReplicaActor:
    name: str
    namespace: str
    pid: int
    deployment: str


def replica_actors(deployment: str, states: tuple[str, ...] = ("ALIVE",)) -> list[ReplicaActor]:
    """The Ray actors of one deployment's replicas in the app, live ones unless ``states`` says
    otherwise (a replica Serve just created is ``DEPENDENCIES_UNREADY`` or ``PENDING_CREATION``).

    Read from the GCS actor table: ``ray.util.state.list_actors`` needs the
    dashboard, which these tests do not start.
    """
    from ray._private.state import actors

    prefix = f"SERVE_REPLICA::{APP_NAME}#{deployment}#"
    return [ReplicaActor(a["Name"], "serve", a["Pid"], deployment) for a in actors().values()
            if a["State"] in states and a["Name"].startswith(prefix)]


def kill_replica(deployment: str) -> ReplicaActor:
    (victim, *_) = replica_actors(deployment)
    kill(victim)
    return victim


def kill(victim: ReplicaActor) -> None:
    ray.kill(ray.get_actor(victim.name, namespace=victim.namespace), no_restart=True)


def rss_kib(pid: int) -> int:
    """Resident memory of a local process, from /proc (psutil is not installed)."""
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1])


def worker_rss_kib() -> dict[str, int]:
    """RSS of every worker replica's process, by actor name."""
    return {a.name: rss_kib(a.pid) for d in ("ContextWorker", "GenerationWorker") for a in replica_actors(d)
            if os.path.exists(f"/proc/{a.pid}")}


def completion_body(prompt: str | list[int] = "Hi", max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            **extra}


def record(test: str, **figures) -> None:
    """Print a test's measured figures; also append them as JSON to $WINDSERVE_RELIABILITY_LOG if set."""
    line = json.dumps({"test": test, **figures}, sort_keys=True)
    print(f"\nRELIABILITY {line}")
    path = os.environ.get("WINDSERVE_RELIABILITY_LOG")
    if path:
        with open(path, "a") as log:
            log.write(line + "\n")


def worker_stats(deployment: str) -> dict:
    """``stats()`` of one replica of a worker deployment, live (not the 1 s board)."""
    handle = serve.get_deployment_handle(deployment, app_name=APP_NAME)
    return handle.stats.remote().result(timeout_s=10)
