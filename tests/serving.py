"""A real Ray + Serve for a test module: a new local Ray, Serve's HTTP proxy on a free 127.0.0.1 port.

On a loaded machine Serve's proxy may take longer to start than its controller waits: the controller
checks its readiness with a 5 s timeout, 3 times, then kills it, and ``serve.start`` raises
ActorDiedError (seen with two busy processes beside a test run). So the check's timeout is raised
(``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S``, read by the controller, which inherits this process's
environment through the Ray started here), and a start that still fails is retried from scratch, at
most START_ATTEMPTS times.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Iterator

import ray
from ray import serve
from ray.exceptions import ActorDiedError, RayTaskError

from app import serve_app
from bench.common import progress, start_ray

START_ATTEMPTS = 3
PROXY_READY_CHECK_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(apps: dict[str, serve.Application]) -> Iterator[str]:
    """Serve each application under ``/<name>``; yields ``http://127.0.0.1:PORT``; shuts all down after."""
    stop_shared()
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(PROXY_READY_CHECK_TIMEOUT_S))
    start_ray(address="local", num_cpus=2)  # a new instance, never a cluster someone else started
    try:
        port = start_serve_on_a_free_port()
        serve.run_many([serve.RunTarget(app, name=name, route_prefix=f"/{name}") for name, app in apps.items()])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def disagg_and_aggregated(engine: dict, model: str) -> Iterator[dict[str, str]]:
    """``engine``'s model served twice at once: disaggregated with 3 n-gram drafts (``/disagg``) and
    aggregated without (``/agg``); yields their base URLs. ``model`` is converted here first, not in
    three workers at once."""
    from engine.model_registry import resolve_model_path

    resolve_model_path(model)
    apps = {"disagg": serve_app.build_app({**engine, "mode": "disagg", "max_draft_len": 3}),
            "agg": serve_app.build_app({**engine, "mode": "aggregated", "transport": "local"})}
    with serving(apps) as base:
        yield {mode: f"{base}/{mode}" for mode in apps}


def start_serve_on_a_free_port() -> int:
    """Serve's controller and proxy on a free port (the module docstring's retry); the port."""
    for attempt in range(1, START_ATTEMPTS + 1):
        port = free_port()
        try:
            serve_app.start_serve(port)
            return port
        except (ActorDiedError, RayTaskError) as exc:  # RayTaskError: the proxy could not bind the port
            serve.shutdown()
            if attempt == START_ATTEMPTS:
                raise
            progress(f"Serve did not start (attempt {attempt} of {START_ATTEMPTS}: {str(exc)[:80]}); retrying")
    raise AssertionError("unreachable")


# One disagg_and_aggregated Serve kept for the next module that asks for the same engine (a module that
# sets SHARES_SERVE = True): the SmolLM2 modules, named test_smollm2*.py so that they run one after another.
# Starting it costs ~2.5 minutes of the 2-core box. Any other module stops it first (tests/conftest.py), and
# so does the session's end: a module never meets a Ray it did not ask for.
_shared: dict[str, tuple[contextlib.AbstractContextManager, dict[str, str]]] = {}


def shared_disagg_and_aggregated(engine: dict, model: str) -> dict[str, str]:
    """``disagg_and_aggregated(engine, model)``'s URLs, started on the first ask and kept for the next."""
    key = json.dumps([engine, model], sort_keys=True)
    if key not in _shared:
        stop_shared()
        served = disagg_and_aggregated(engine, model)
        _shared[key] = (served, served.__enter__())
    return _shared[key][1]


def stop_shared() -> None:
    while _shared:
        _, (served, _) = _shared.popitem()
        served.__exit__(None, None, None)
