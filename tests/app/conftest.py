"""Fixtures of the app tests; the fakes they serve live in tests.app.fakes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from app.api import build_api
from tests.app.fakes import ByteTokenizer, FakeBackend, LiveServer, openai_client


@pytest.fixture(scope="session")
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture(scope="session")
def server(backend: FakeBackend) -> Iterator[LiveServer]:
    live = LiveServer(build_api(backend, ByteTokenizer())).start()
    yield live
    live.stop()


@pytest.fixture(scope="session")
def client(server: LiveServer) -> openai.OpenAI:
    return openai_client(server.url)


@pytest.fixture(scope="session")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as http_client:
        yield http_client


@pytest.fixture
def make_server() -> Iterator[Callable[..., LiveServer]]:
    """Starts servers with their own backend and options; stops them after the test."""
    started: list[LiveServer] = []

    def make(backend=None, tokenizer=None, **options) -> LiveServer:
        app = build_api(backend or FakeBackend(), tokenizer or ByteTokenizer(), **options)
        started.append(LiveServer(app).start())
        return started[-1]

    yield make
    for live in started:
        live.stop()
