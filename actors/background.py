"""One background task of an actor: started once on the running loop, stopped by cancelling it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundTask:
    """``start()`` runs ``run()`` on the running event loop (once); ``stop()`` cancels and awaits it."""

    def __init__(self, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._run = run
        self._task: asyncio.Task | None = None

    @property
    def is_running(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
