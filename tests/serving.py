"""A real Ray + Serve for a test module: a new local Ray, Serve's HTTP proxy on a free 127.0.0.1 port."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import ray
from ray import serve

from bench.common import start_ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(apps: dict[str, serve.Application]) -> Iterator[str]:
    """Serve each application under ``/<name>``; yields ``http://127.0.0.1:PORT``; shuts all down after."""
    start_ray(address="local", num_cpus=2)  # a new instance, never a cluster someone else started
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run_many([serve.RunTarget(app, name=name, route_prefix=f"/{name}") for name, app in apps.items()])
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
