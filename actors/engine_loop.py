"""Drives an LLMEngine inside an async actor: steps on a thread of their own, updates to per-request queues.

One thread, ``engine-step`` (named so that ``top -H`` and bench.serve_threads can tell
it apart from the actor's other threads), owns the engine: it runs the engine calls
that ``call`` hands it, between steps, and the steps back to back while requests are
unfinished, so the engine is never touched by two threads at once. Each step's updates
reach the per-request queues on the actor's event loop (``call_soon_threadsafe``,
in the order the thread made them), while the next step already runs: the loop's
per-token work (the stream, Serve's messages) no longer sits between two steps.
If a step raises, every request in flight gets an ``error`` update and is
aborted (its pages freed); the loop keeps serving new requests.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

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
        self._commands: deque[tuple[Callable, tuple, dict, concurrent.futures.Future, bool]] = deque()
        self._work = threading.Event()  # set: a command or a start is waiting for the step thread
        self._thread: threading.Thread | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._stepping = False  # start() sets it: until then the thread runs calls, no steps
        self._queues: dict[str, asyncio.Queue[RequestUpdate]] = {}
        self.is_tracing = is_tracing_path()  # updates carry their hop times (engine.outputs.TRACE_PATH_ENV)

    def start(self) -> None:
        """Step the engine whenever it has unfinished requests (from the running event loop)."""
        self._bind()
        self._stepping = True
        self._work.set()

    def stop(self) -> None:
        """No more steps after the one running (if any) ends; calls still run."""
        self._stepping = False

    async def call(self, fn: Callable, *args, **kwargs):
        """Run a quick engine call on the step thread, between two steps."""
        return await self._submit(fn, args, kwargs, deliver=False)

    async def call_and_deliver(self, fn: Callable, *args, **kwargs) -> list[RequestUpdate]:
        """``call`` a function that returns updates, and deliver them before any later step's."""
        return await self._submit(fn, args, kwargs, deliver=True)

    async def _submit(self, fn: Callable, args: tuple, kwargs: dict, deliver: bool):
        self._bind()
        return await asyncio.wrap_future(self._enqueue(fn, args, kwargs, deliver))

    def _send(self, fn: Callable, *args) -> None:
        """Queue a call behind those already queued, without waiting for it (from the event loop)."""
        self._enqueue(fn, args, {}, deliver=False)

    def _enqueue(self, fn: Callable, args: tuple, kwargs: dict, deliver: bool) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.append((fn, args, kwargs, future, deliver))
        self._work.set()
        return future

    def _bind(self) -> None:
        self._event_loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=STEP_THREAD_NAME, daemon=True)
            self._thread.start()

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

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile the request's grammar (if any) off the step thread, so the engine's add finds it cached
        (engine.grammar_compile); GrammarError if it does not compile within the deadline."""
        if params.grammar is not None:
            await asyncio.to_thread(self.engine.grammars.compile, params.grammar)

    async def _add(self, add: Callable, request_id: str, prompt_token_ids: list[int],
                   params: SamplingParams) -> asyncio.Queue[RequestUpdate]:
        await self.compile_grammar(params)
        queue = self.watch(request_id)
        try:
            await self.call(add, request_id, prompt_token_ids, params)
        except BaseException:  # a failed add, or a caller gone while it ran: nothing may keep stepping it
            self.unwatch(request_id)
            self._send(self.engine.abort, request_id)
            raise
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

    def _run(self) -> None:
        """The step thread: calls as they come, steps while there is work and the loop is started."""
        name_os_thread(STEP_THREAD_NAME)
        while True:
            self._work.clear()
            self._run_commands()
            if not (self._stepping and self.engine.has_unfinished()):
                self._work.wait()
                continue
            started = time.monotonic()
            try:
                updates = self.engine.step()
            except Exception as exc:  # a failed step must not strand requests
                log.exception("engine step failed")
                updates = self._fail_all(exc)
            if self.is_tracing:
                for update in updates:
                    update.stamps = {"step_start": started, "step_end": time.monotonic()}
            if updates:
                self._post(updates)

    def _run_commands(self) -> None:
        while self._commands:
            fn, args, kwargs, future, deliver = self._commands.popleft()
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away before it ran
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
                continue
            if deliver and result:
                self._post(result)
            future.set_result(result)

    def _post(self, updates: list[RequestUpdate]) -> None:
        try:
            self._event_loop.call_soon_threadsafe(self.deliver, updates)
        except RuntimeError:  # the event loop is closed: nobody is left to read these
            log.warning("engine loop: %d updates for a closed event loop dropped", len(updates))

    def _fail_all(self, exc: Exception) -> list[RequestUpdate]:
        updates = []
        for request in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort(request.request_id)
            updates.append(RequestUpdate(request.request_id, [], "", request.num_prompt_tokens,
                                         request.num_output_tokens, finish_reason=FinishReason.ERROR,
                                         error=f"engine step failed: {type(exc).__name__}: {exc}"))
        return updates
