"""Drives an LLMEngine inside an async actor: steps in a thread, updates to per-request queues.

All engine calls go through ``call`` (under one asyncio lock), and the step
runs under the same lock in the loop's own thread (``engine-step``: every step on
one OS thread, named so that ``top -H`` and bench.serve_threads can tell it
apart from the actor's other threads), so the engine is never touched
by two threads at once while the actor's event loop stays free for calls.
If a step raises, every request in flight gets an ``error`` update and is
aborted (its pages freed); the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from engine import LLMEngine, RequestUpdate, SamplingParams
from engine.outputs import FinishReason, is_tracing_path, merge_updates, stamp

log = logging.getLogger(__name__)


async def next_merged(queue: asyncio.Queue[RequestUpdate]) -> RequestUpdate:
    """The next update, merged with every one queued behind it (``engine.outputs.merge_updates``)::

        queue: [u3, u4, u5]   ->   merge(u3, u4, u5)      (nothing waits: the queue is drained as it is)
        queue: []             ->   waits for u6, then merges whatever queued behind it meanwhile

    A finished update ends a merge: nothing follows it in a request's stream.
    """
    ready = [await queue.get()]
    while not ready[-1].is_finished and not queue.empty():
        ready.append(queue.get_nowait())
    return merge_updates(ready)


STEP_THREAD_NAME = "engine-step"


def name_os_thread(name: str) -> None:
    """Give the calling thread an OS-visible name (Linux, at most 15 bytes kept); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        pr_set_name = 15
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._stepper = ThreadPoolExecutor(1, thread_name_prefix=STEP_THREAD_NAME, initializer=name_os_thread,
                                           initargs=(STEP_THREAD_NAME,))
        self._lock = asyncio.Lock()
        self._wakeup = asyncio.Event()
        self._queues: dict[str, asyncio.Queue[RequestUpdate]] = {}
        self._task: asyncio.Task | None = None
        self.is_tracing = is_tracing_path()  # updates carry their hop times (engine.outputs.TRACE_PATH_ENV)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def call(self, fn: Callable, *args, **kwargs):
        """Run a quick engine call between steps."""
        async with self._lock:
            return fn(*args, **kwargs)

    def watch(self, request_id: str) -> asyncio.Queue[RequestUpdate]:
        queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def unwatch(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    def deliver(self, updates: list[RequestUpdate]) -> None:
        for update in updates:
            queue = self._queues.get(update.request_id)
            if queue is not None:
                queue.put_nowait(update)
        self._wakeup.set()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """Add a request and yield its updates until it finishes; abort it if the consumer goes away."""
        queue = await self._add(self.engine.add_request, request_id, prompt_token_ids, params)
        async for update in self.stream(request_id, queue):
            yield update

    async def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestUpdate:
        """Prefill a prompt to its handoff; the request stays parked with its pages until ``abort``.

        Returns the parked update, the request's only one (the engine reports nothing
        before the handoff): its k outputs, and ``prefill``, the ``PrefillResult``.
        Raises RuntimeError (with the engine's error text) if it fails or is aborted first.
        """
        queue = await self._add(self.engine.prefill, request_id, prompt_token_ids, params)
        last = None
        async for update in self.stream(request_id, queue):
            last = update
        if last is None or last.prefill is None:
            why = (last.error or last.finish_reason) if last is not None else "no output"
            raise RuntimeError(f"prefill of {request_id!r} failed: {why}")
        return last

    async def _add(self, add: Callable, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams) -> asyncio.Queue[RequestUpdate]:
        queue = self.watch(request_id)
        try:
            await self.call(add, request_id, prompt_token_ids, params)
        except Exception:
            self.unwatch(request_id)
            raise
        self._wakeup.set()
        return queue

    async def stream(self, request_id: str, queue: asyncio.Queue[RequestUpdate]) -> AsyncIterator[RequestUpdate]:
        """Yield updates until the last; a consumer leaving early aborts the request.

        A consumer that fell behind gets what queued up meanwhile as one update
        (``next_merged``): one message down the serving path instead of one per step.
        """
        finished = False
        try:
            while not finished:
                update = await next_merged(queue)
                finished = update.is_finished
                stamp(update, "loop_get")
                yield update
        finally:
            self.unwatch(request_id)
            if not finished:
                await self.call(self.engine.abort, request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort wherever the request is; a watcher gets a final ``abort`` update."""
        existed = await self.call(self.engine.abort, request_id)
        if request_id in self._queues:
            self.deliver([RequestUpdate(request_id, [], "", 0, 0, finish_reason=FinishReason.ABORT)])
        return existed

    async def _run(self) -> None:
        while True:
            if not self.engine.has_unfinished():
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            async with self._lock:
                started = time.monotonic()
                try:
                    updates = await asyncio.get_running_loop().run_in_executor(self._stepper, self.engine.step)
                except Exception as exc:  # a failed step must not strand requests
                    log.exception("engine step failed")
                    updates = self._fail_all(exc)
            if self.is_tracing:
                for update in updates:
                    update.stamps = {"step_start": started, "step_end": time.monotonic()}
            self.deliver(updates)
            await asyncio.sleep(0)

    def _fail_all(self, exc: Exception) -> list[RequestUpdate]:
        updates = []
        for request in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(request.request_id)
            updates.append(RequestUpdate(request.request_id, [], "", request.num_prompt_tokens,
                                         request.num_output_tokens, finish_reason=FinishReason.ERROR,
                                         error=f"engine step failed: {type(exc).__name__}: {exc}"))
        return updates
