"""``n`` choices of one request: the request fanned out into n child requests (issue 47).

vLLM v1 samples in parallel the same way (its front end fans a request with ``n`` out into n child
requests): the engine, the scheduler, the handoff and the router see n ordinary requests, and
nothing below the app learns what ``n`` is. Child ``i``::

    request id   <id>-<i>
    seed         seed + i when the request has a seed (past 2**64 - 1 it wraps to 0, 1, ...);
                 unseeded children draw independently
    the rest     as asked: max_tokens, stop, logprobs, the grammar of response_format ...

so child ``i`` gives the tokens a single request with seed ``seed + i`` gives.

The prompt is prefilled once, through the prefix cache: child 0 starts first, children 1..n-1 once
child 0's first update arrives. That update comes after child 0's prompt is computed and its full
blocks named (engine.engine: ``_cache_computed`` runs before the update is taken), so each later
child's admission finds every full block of the prompt cached and computes only the rest::

    P prompt tokens, B tokens per block; the hit leaves at least one prompt token to compute:
        h = ((P - 1) // B) * B
    child 0 computes P tokens; children 1..n-1 compute P - h, in [1, B]: the last partial page
    again (a whole last page when B divides P: its last token's logits sample token 0)

Disaggregated, child 0's first update is the context replica's ``Prefilled``: the prompt's pages
are held under a lease there, full blocks named. The children's context calls carry the same
prompt's block hashes in their RoutingHint; the KV-aware router (app.routing) ranks replicas by the
hit they would give, and counts its own decision for child 0 at once (app.pending), so the children
go to child 0's replica unless its load outweighs the hit (then they prefill elsewhere: the same
tokens, computed again). A generation replica that already holds the prompt's blocks pulls only
what it lacks. A short uncached part may also be prefilled on a generation replica
(``local_prefill_max_tokens``): that is the children's P - h tokens on a hit there.

Usage counts the prompt once (with child 0's cached tokens) and the outputs of every child. A
child that fails, or a client that leaves, ends every child: each child's GenerationRun aborts its
request in the backend on the way out, so no child keeps decoding or holding pages.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.errors import SERVER_ERROR, APIError, error_body
from app.generation import GenerationRun, ServingContext, call_unless_disconnected
from app.protocol import SamplingFields
from app.streaming import (
    CLIENT_CLOSED_REQUEST,
    DONE_EVENT,
    Collected,
    EventStreamResponse,
    ReplyFormatter,
    failed_update_error,
    sse_event,
    traced,
    usage_dict,
)
from engine.outputs import RequestUpdate
from engine.params import SamplingParams

logger = logging.getLogger(__name__)
SEED_SPACE = 2**64  # SamplingFields.seed spans [-2**63, 2**64)


def child_seed(seed: int | None, index: int) -> int | None:
    if seed is None:
        return None
    seed += index
    return seed - SEED_SPACE if seed >= SEED_SPACE else seed


def child_runs(ctx: ServingContext, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               n: int) -> list[GenerationRun]:
    return [GenerationRun(ctx, f"{request_id}-{i}", prompt_token_ids,
                          dataclasses.replace(params, seed=child_seed(params.seed, i))) for i in range(n)]


class FanOut:
    """The updates of n child runs as ``(index, update)``, as they arrive; ``async with``, ``async for``.

    Each child runs in a task of its own, children 1..n-1 from child 0's first update on (module
    docstring), in a fresh context: under Ray Serve, a call made in a request's context carries that
    request's internal id, and Serve's router (Ray 2.60) indexes the calls waiting for a replica by
    that id, so two concurrent calls of one request to one deployment collide and all but one wait
    unrouted (seen: children 2 and 3 of n=4 never reached the worker). Serve's own cancellation of a
    request's calls thus does not reach the children; leaving the ``async with`` does: it cancels
    every task, and a child not finished then is aborted by its GenerationRun's exit. An exception a
    child raised is raised to the consumer.
    """

    def __init__(self, runs: list[GenerationRun]) -> None:
        self.runs = runs
        self._updates: asyncio.Queue[tuple[int, RequestUpdate | None, BaseException | None]] = asyncio.Queue()
        self._prompt_computed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._num_unfinished = len(runs)

    async def __aenter__(self) -> FanOut:
        self._tasks = [asyncio.get_running_loop().create_task(self._drive(i, run), context=contextvars.Context())
                       for i, run in enumerate(self.runs)]
        return self

    async def _drive(self, index: int, run: GenerationRun) -> None:
        try:
            if index > 0:
                await self._prompt_computed.wait()
            async with run:
                async for update in run:
                    self._prompt_computed.set()  # only child 0 runs before it is set
                    self._updates.put_nowait((index, update, None))
        except Exception as exc:
            self._updates.put_nowait((index, None, exc))

    def __aiter__(self) -> FanOut:
        return self

    async def __anext__(self) -> tuple[int, RequestUpdate]:
        if self._num_unfinished == 0:
            raise StopAsyncIteration
        index, update, error = await self._updates.get()
        if error is not None:
            raise error
        self._num_unfinished -= update.is_finished
        return index, update

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):  # the children's exits (aborts) run even if we were cancelled
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def usage(self) -> dict:
        """The prompt once, with child 0's cached tokens; the outputs of every child."""
        first = self.runs[0]
        return usage_dict(len(first.prompt_token_ids), sum(run.num_output_tokens for run in self.runs),
                          first.num_cached_tokens)


def indexed(obj: dict, index: int) -> dict:
    """``obj`` (a formatter's chunk or response) with every choice at ``index``."""
    return obj | {"choices": [choice | {"index": index} for choice in obj["choices"]]}


async def collect_choices(fanout: FanOut) -> list[Collected]:
    """Every child run to its end; a failed child raises APIError (500) and ends the others."""
    collected = [Collected() for _ in fanout.runs]
    async with fanout:
        async for index, update in fanout:
            if update.finish_reason == "error":
                raise failed_update_error(update)
            choice = collected[index]
            choice.text_parts.append(update.new_text)
            choice.logprobs.extend(update.logprobs or ())
            choice.num_output_tokens = update.num_output_tokens
            choice.finish_reason = update.finish_reason or ""
    return collected


async def stream_choice_events(fanout: FanOut, formatters: list[ReplyFormatter],
                               include_usage: bool) -> AsyncIterator[str]:
    """SSE events of n choices, in app.streaming's format: each chunk names its choice's ``index``,
    each choice ends with its own finish chunk, one usage chunk closes the stream."""
    try:
        async with fanout:
            for index, formatter in enumerate(formatters):
                for chunk in formatter.stream_start():
                    yield sse_event(indexed(chunk, index))
            async for index, update in fanout:
                if update.finish_reason == "error":
                    raise failed_update_error(update)
                for chunk in traced(formatters[index].stream_update(update), update):
                    yield sse_event(indexed(chunk, index))
                if update.is_finished:
                    yield sse_event(indexed(formatters[index].stream_finish(update.finish_reason), index))
        if include_usage:
            yield sse_event(formatters[0].stream_usage(fanout.usage()))
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception:
        logger.exception("stream of %s failed", fanout.runs[0].request_id)
        yield sse_event(error_body("Internal server error", SERVER_ERROR))
    yield DONE_EVENT


async def respond_choices(request: Request, ctx: ServingContext, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams, body: SamplingFields,
                          make_formatter: Callable[[], ReplyFormatter]) -> Response:
    """The reply with ``body.n`` choices, streamed or whole; one formatter per choice (each keeps its
    own stream state), all stamped with the first one's ``created``."""
    fanout = FanOut(child_runs(ctx, request_id, prompt_token_ids, params, body.n))
    formatters = [make_formatter() for _ in range(body.n)]
    for formatter in formatters[1:]:
        formatter.created = formatters[0].created
    if body.stream:
        return EventStreamResponse(stream_choice_events(fanout, formatters, body.include_usage))
    collected = await call_unless_disconnected(request.receive, lambda: collect_choices(fanout))
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    usage = fanout.usage()
    bodies = [indexed(f.response(c, usage), i) for i, (f, c) in enumerate(zip(formatters, collected))]
    return JSONResponse(bodies[0] | {"choices": [choice for b in bodies for choice in b["choices"]]})
