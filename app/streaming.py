"""Turning a GenerationRun into an OpenAI reply: one JSON body, or SSE chunks.

The wire format of a stream (``text/event-stream``)::

    data: {chunk}\\n\\n          one per event, chunk = an OpenAI *.chunk object
    ...
    data: {usage chunk}\\n\\n    only with stream_options.include_usage: choices == []
    data: [DONE]\\n\\n

A failure after the 200 went out cannot change the status any more; it is
sent as one ``data: {"error": {...}}`` event before ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from app.errors import SERVER_ERROR, APIError, error_body
from app.generation import GenerationRun, call_unless_disconnected
from engine.outputs import RequestUpdate, TokenLogprob

logger = logging.getLogger(__name__)
DONE_EVENT = "data: [DONE]\n\n"
MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client left first"; only metrics see it


@dataclass
class Collected:
    """Everything a finished, non-streamed request produced."""

    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    num_output_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class ReplyFormatter(Protocol):
    """Builds one endpoint's JSON objects; may keep state across one stream."""

    def stream_start(self) -> list[dict]: ...
    def stream_update(self, update: RequestUpdate) -> list[dict]: ...
    def stream_finish(self, finish_reason: str) -> dict: ...
    def stream_usage(self, usage: dict) -> dict: ...
    def response(self, collected: Collected, usage: dict) -> dict: ...


class EventStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator.

    Starlette leaves the iterator suspended when ``send`` fails (client gone
    under ASGI spec >= 2.4); closing it runs the GenerationRun's exit, which
    aborts the request, now rather than whenever the generator is collected.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None]) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


def finite_logprob(value: float) -> float:
    return MIN_LOGPROB if math.isnan(value) else max(value, MIN_LOGPROB)


def usage_dict(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: the prompt tokens whose KV a prefix cache supplied
    (the context side's hit when disaggregated), as OpenAI and vLLM report it."""
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


def sse_event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def failed_update_error(update: RequestUpdate) -> APIError:
    return APIError(500, update.error or "generation failed", type=SERVER_ERROR)


async def collect(run: GenerationRun) -> Collected:
    """Runs the request to its end; a failed request raises APIError (500)."""
    collected = Collected()
    async with run:
        async for update in run:
            collected.text_parts.append(update.new_text)
            collected.logprobs.extend(update.logprobs or ())
            collected.num_output_tokens = update.num_output_tokens
            if update.finish_reason == "error":
                raise failed_update_error(update)
            collected.finish_reason = update.finish_reason or ""
    return collected


def run_usage(run: GenerationRun) -> dict:
    return usage_dict(len(run.prompt_token_ids), run.num_output_tokens, run.num_cached_tokens)


def traced(chunks: list[dict], update: RequestUpdate) -> list[dict]:
    """``chunks``, the first carrying the update's hop times as ``windserve_trace`` when it has them
    (engine.outputs.TRACE_PATH_ENV: a debug field for bench.serve_path, absent by default)."""
    if update.stamps is not None and chunks:
        update.stamps["sse_out"] = time.monotonic()
        chunks[0]["windserve_trace"] = {**update.stamps, "num_tokens": len(update.new_token_ids)}
    return chunks


async def stream_events(
    run: GenerationRun, formatter: ReplyFormatter, include_usage: bool
) -> AsyncIterator[str]:
    """SSE events of one run, in the format of the module docstring."""
    try:
        async with run:
            for chunk in formatter.stream_start():
                yield sse_event(chunk)
            async for update in run:
                if update.finish_reason == "error":
                    raise failed_update_error(update)
                for chunk in traced(formatter.stream_update(update), update):
                    yield sse_event(chunk)
                if update.is_finished:
                    yield sse_event(formatter.stream_finish(update.finish_reason))
        if include_usage:
            yield sse_event(formatter.stream_usage(run_usage(run)))
    except APIError as exc:
        yield sse_event(exc.body())
    except Exception:
        logger.exception("stream of %s failed", run.request_id)
        yield sse_event(error_body("Internal server error", SERVER_ERROR))
    yield DONE_EVENT


async def respond(
    request: Request, run: GenerationRun, formatter: ReplyFormatter, *, stream: bool, include_usage: bool
) -> Response:
    """The reply of one run, streamed or whole."""
    if stream:
        return EventStreamResponse(stream_events(run, formatter, include_usage))
    collected = await call_unless_disconnected(request.receive, lambda: collect(run))
    if collected is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(formatter.response(collected, run_usage(run)))
