"""In-process stand-ins for Serve deployment handles (no Ray), for app.serve_backend's tests.

    handle.options(stream=True).method.remote(*args)  ─►  FakeStream  (an async generator method)
    handle.method.remote(*args)                       ─►  FakeCall    (a coroutine method)

As with Serve, a call starts running when ``remote`` is called, whether or not
anyone reads it yet: a FakeStream drives its generator in a task of its own
into a queue. Every call is recorded, and so is its cancellation.

``FakeDeployment.max_accepted`` (None: no limit) stands for a deployment whose
replicas are gone: a FakeCall past that many waits, unaccepted (Serve's
``_fetch_future_result_async`` does not return), until ``accept_waiting()``.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    method: str
    args: tuple
    kwargs: dict
    is_cancelled: bool = False


class FakeCall:
    """A DeploymentResponse: awaitable once, cancellable; runs once a replica accepts it."""

    def __init__(self, record: Call, coroutine, accepted: asyncio.Event | None = None) -> None:
        self.record = record
        self.accepted = accepted or asyncio.Event()
        if accepted is None:
            self.accepted.set()
        self._task = asyncio.ensure_future(self._run(coroutine))

    async def _run(self, coroutine):
        try:
            await self.accepted.wait()
        except asyncio.CancelledError:
            coroutine.close()
            raise
        return await coroutine

    async def _fetch_future_result_async(self) -> FakeCall:
        await self.accepted.wait()
        return self

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self.record.is_cancelled = True
        self._task.cancel()


_END = object()


class FakeStream:
    """A DeploymentResponseGenerator: async-iterable, cancellable; its generator runs from ``remote`` on."""

    def __init__(self, record: Call, generator) -> None:
        self.record = record
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.ensure_future(self._drive(generator))

    async def _drive(self, generator) -> None:
        try:
            async for item in generator:
                await self._queue.put(item)
        except Exception as exc:  # re-raised to the reader, as Serve does
            await self._queue.put(exc)
        await self._queue.put(_END)

    def __aiter__(self) -> FakeStream:
        return self

    async def __anext__(self) -> Any:
        item = await self._queue.get()
        if item is _END:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def cancel(self) -> None:
        self.record.is_cancelled = True
        self._task.cancel()


@dataclass
class FakeDeployment:
    """A handle whose methods are the given async functions and async generator functions."""

    methods: dict[str, Any]
    calls: list[Call] = field(default_factory=list)
    max_accepted: int | None = None
    waiting: list[asyncio.Event] = field(default_factory=list)

    def acceptance(self) -> asyncio.Event | None:
        """None (accepted at once) within ``max_accepted`` calls, else an event not set yet."""
        if self.max_accepted is None or len(self.calls) <= self.max_accepted:
            return None
        self.waiting.append(asyncio.Event())
        return self.waiting[-1]

    def accept_waiting(self) -> None:
        for event in self.waiting:
            event.set()

    def options(self, **options) -> FakeDeployment:
        return self

    def __getattr__(self, name: str) -> _Method:
        if name in ("methods", "calls", "max_accepted", "waiting") or name not in self.methods:
            raise AttributeError(name)
        return _Method(self, name)

    def called(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]


@dataclass
class _Method:
    deployment: FakeDeployment
    name: str

    def remote(self, *args, **kwargs):
        record = Call(self.name, args, kwargs)
        self.deployment.calls.append(record)
        fn = self.deployment.methods[self.name]
        if inspect.isasyncgenfunction(fn):
            return FakeStream(record, fn(*args, **kwargs))
        return FakeCall(record, fn(*args, **kwargs), self.deployment.acceptance())


def fake_board() -> FakeDeployment:
    async def snapshot() -> list[dict]:
        return []

    return FakeDeployment({"snapshot": snapshot})
