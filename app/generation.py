"""One request's trip through the backend, shared by completions and chat.

A request that leaves before the backend reported its finish (client gone,
error, cancellation by the server) must not keep decoding: ``GenerationRun``
aborts it in the backend on the way out, whatever way out that is.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive

from app.backend import Backend, ServingTokenizer
from app.errors import bad_request, model_not_found
from app.metrics import ServingMetrics
from app.protocol import SamplingFields, clamp_max_tokens
from engine.grammar import GrammarError
from engine.grammar_compile import GrammarCompiler
from engine.outputs import RequestUpdate
from engine.params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
CLEANUP_TIMEOUT_S = 10.0  # for backend.abort and closing its stream


def grammar_compiler_for(tokenizer: ServingTokenizer) -> GrammarCompiler | None:
    """The ingress's grammar checker, over the tokenizer's own vocabulary; None for a tokenizer without
    a Hugging Face one underneath (the test fakes: their backends ignore grammars)."""
    hf_tokenizer = getattr(tokenizer, "hf_tokenizer", None)
    return GrammarCompiler(hf_tokenizer, tokenizer.vocab_size) if hf_tokenizer is not None else None


@dataclass
class ServingContext:
    """What every route needs; one per app, never shared between apps."""

    backend: Backend
    tokenizer: ServingTokenizer
    metrics: ServingMetrics
    grammars: GrammarCompiler | None = None  # None: the tokenizer has no vocabulary to compile against (fakes)
    created: int = field(default_factory=lambda: int(time.time()))
    # Abort tasks outlive the (possibly cancelled) request task; hold them until done.
    pending_aborts: set[asyncio.Task] = field(default_factory=set)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.backend.model_name:
            raise model_not_found(model)

    async def encode(self, text: str) -> list[int]:
        return await run_in_threadpool(self.tokenizer.encode_prompt, text)

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """``tools`` only where the template takes them (app.tool_prompt)."""
        args = (messages,) if tools is None else (messages, tools)
        try:
            return await run_in_threadpool(self.tokenizer.apply_chat_template, *args)
        except ValueError as exc:
            raise bad_request(f"Could not apply the chat template: {exc}", param="messages") from exc

    def sampling_params(self, request: SamplingFields, prompt_len: int, param: str) -> SamplingParams:
        """Checks the prompt fits (see app.protocol for the length policy)."""
        max_model_len = self.backend.max_model_len
        if prompt_len >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{prompt_len} tokens, which leaves no room to generate.",
                param=param,
                code="context_length_exceeded",
            )
        max_tokens = clamp_max_tokens(request.requested_max_tokens(), prompt_len, max_model_len)
        try:
            params = request.to_sampling_params(max_tokens)
        except ValueError as exc:
            raise bad_request(str(exc), param=getattr(exc, "param", None)) from exc
        self._check_logit_bias(params)
        return params

    async def check_grammar(self, request: SamplingFields, params: SamplingParams) -> None:
        """A grammar that does not compile within the deadline is a 400 naming its field, before
        anything is queued (compiled on a thread of its own, cached: engine.grammar_compile)."""
        if params.grammar is None or self.grammars is None:
            return
        try:
            await asyncio.to_thread(self.grammars.compile, params.grammar)
        except GrammarError as exc:
            raise bad_request(str(exc), param=request.requested_grammar()[0]) from exc

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """A bias on a token the model does not have would be dropped: a 400 naming it instead."""
        vocab_size = getattr(self.tokenizer, "vocab_size", None)  # test tokenizers may not say
        outside = [token_id for token_id, _ in params.logit_bias if vocab_size is not None and token_id >= vocab_size]
        if outside:
            raise bad_request(f"logit_bias: token id {outside[0]} is outside the vocabulary (size {vocab_size})",
                              param="logit_bias")


class GenerationRun:
    """Iterates one request's updates; use as ``async with`` then ``async for``.

    Leaving the ``async with`` before a finished update arrived aborts the
    request in the backend (in its own task, so a cancelled caller cannot
    interrupt the abort). Timing metrics are recorded on the way out.
    """

    def __init__(
        self, ctx: ServingContext, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens whose KV came from a prefix cache (usage)
        self.finish_reason: str | None = None
        self._stream: Any = None
        self._arrival = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_at: float | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    async def __aenter__(self) -> GenerationRun:
        self._stream = self.ctx.backend.generate(self.request_id, self.prompt_token_ids, self.params)
        return self

    def __aiter__(self) -> GenerationRun:
        return self

    async def __anext__(self) -> RequestUpdate:
        if self.is_finished:
            raise StopAsyncIteration
        try:
            update = await anext(self._stream)
        except StopAsyncIteration:
            raise RuntimeError(f"backend stream of {self.request_id} ended unfinished") from None
        self._observe(update)
        return update

    def _observe(self, update: RequestUpdate) -> None:
        if update.new_token_ids:
            self._last_token_at = time.monotonic()
            if self._first_token_at is None:
                self._first_token_at = self._last_token_at
        self.num_output_tokens = update.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, update.num_cached_tokens)
        self.finish_reason = update.finish_reason

    async def __aexit__(self, *exc_info: object) -> None:
        if not self.is_finished:
            self._start_abort()
        self._record_metrics()
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            with anyio.move_on_after(CLEANUP_TIMEOUT_S, shield=True):
                await aclose()

    def _start_abort(self) -> None:
        """Run the abort in a fresh context: under Ray Serve, a call made in a request's context is
        that request's child, and Serve cancels the children of a cancelled request (a client that
        disconnected), so an abort started in it could be cancelled before it was sent."""
        coro = _abort(self.ctx.backend, self.request_id)
        task = asyncio.get_running_loop().create_task(coro, context=contextvars.Context())
        self.ctx.pending_aborts.add(task)
        task.add_done_callback(self.ctx.pending_aborts.discard)

    def _record_metrics(self) -> None:
        ttft = tpot = None
        if self._first_token_at is not None:
            ttft = self._first_token_at - self._arrival
            if self.num_output_tokens > 1:
                tpot = (self._last_token_at - self._first_token_at) / (self.num_output_tokens - 1)
        self.ctx.metrics.observe_finished(
            ttft_s=ttft,
            tpot_s=tpot,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_output_tokens=self.num_output_tokens,
        )


async def _abort(backend: Backend, request_id: str) -> None:
    try:
        with anyio.fail_after(CLEANUP_TIMEOUT_S):
            await backend.abort(request_id)
    except Exception:
        logger.exception("abort of %s failed", request_id)


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def call_unless_disconnected(receive: Receive, fn: Callable[[], Awaitable[T]]) -> T | None:
    """``await fn()``, cancelled if the client disconnects first (then None).

    For responses that are not streamed: the body was read already, so the
    next ASGI message is the disconnect, or nothing until the reply is sent.
    """
    outcome: dict[str, Any] = {}

    async def work() -> None:
        try:
            outcome["result"] = await fn()
        except Exception as exc:  # re-raised below, outside the task group
            outcome["error"] = exc
        task_group.cancel_scope.cancel()

    async def watch() -> None:
        await wait_for_disconnect(receive)
        task_group.cancel_scope.cancel()

    async with anyio.create_task_group() as task_group:
        task_group.start_soon(work)
        task_group.start_soon(watch)
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")
