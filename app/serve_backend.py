"""app.backend's Backend over Serve deployment handles.

    hint = hasher.hint(request_id, prompt)                      (app.placement: the prompt hashed once)
    aggregated:  stream aggregated.generate(request_id, prompt, params, hint=hint)
    disagg, short uncached part (P - best generation-side hit <= local_prefill_max_tokens):
                 stream generation.generate_local(request_id, prompt, params, hint=hint)
    disagg:

      ingress                         context replica              generation replica
        │ prefill(request_id, ...) ──────►│ prefill, sample t0 .. t(k-1): up to the first visible text
        │◄── Prefilled(first, kv) ────────┤ pages under a lease (kv=None: an output ended it, pages freed)
        │ kv=None: yield first, done      │
        │ generate(kv, ...) ─────────────────────────────────────────►│ reserve, claim, pull, release
        │ yield first  (t0..t(k-1) out while the KV moves)            │ add_prefilled: t0..t(k-1) again
        │◄── update 0: the k outputs again: only the rest passes ─────┤
        │◄── updates 1.. as they are ─────────────────────────────────┤ decode

      the context replica unavailable before token 0 (it died, its actor is gone, Serve has
      none): generation.generate_local instead, counted in ``num_context_fallbacks``.

A bounded wait for a dead context replica. A request that no context replica
has accepted yet (queued in the router, or being re-sent by Serve after the
replica it was sent to died) would wait for Serve's replacement, 6-21 s. Once
a context call failed as unavailable (``is_unavailable``), the context
deployment is suspect for CONTEXT_SUSPECT_S; while it is, a request whose call
no replica has accepted falls back to a local prefill at most
CONTEXT_WAIT_BOUND_S after the later of its start and the failure::

    t_fail: a context call fails as unavailable     suspect until t_fail + CONTEXT_SUSPECT_S
    request started at t0, not accepted yet          falls back by max(t0, t_fail) + CONTEXT_WAIT_BOUND_S
                                                     (checked every CONTEXT_POLL_S)

A request a replica has accepted waits for its prefill (a dead replica fails it
at once: the fallback above). With no failure seen, the wait is Serve's own
(backpressure while every replica is at ``max_ongoing_requests``).

Each request's path is remembered (``paths``, bounded, newest last): "context"
(prefilled by a context replica), "fell back: unavailable" (its call failed
with the replica gone), "fell back: wait bound" (no replica accepted it in the
bound), "local" (a short uncached part, by choice), "failed" (an error reached
the client).

The generation call is opened by a task created just before ``first`` is
yielded: it runs as soon as the loop is free (while the consumer sends
``first`` to the client), so the open is not on token 0's path and does not
wait for the consumer's next pull; the KV moves meanwhile.

Every call carries the hint for the KV-aware router (app.routing), which
places it by cache hit and load, and remembers where each request id went.
A request left before its finish (client gone) has its in-flight call
cancelled: Serve cancels the replica's task, whose worker stream aborts the
request and frees its pages. ``abort`` also asks every worker deployment to
abort the id, with a hint naming it, so that each deployment's router sends
it to the replica holding the request (sticky cancellation); a deployment
that never saw the id gets it on any replica, where it is a no-op.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from actors.messages import KVHandle, Prefilled
from app.placement import GenerationCaches, PromptHasher
from app.routing import RoutingHint
from engine.outputs import RequestUpdate, stamp, without_first_token
from engine.params import SamplingParams

log = logging.getLogger(__name__)
HEALTH_TIMEOUT_S = 10.0
CONTEXT_WAIT_BOUND_S = 2.0
CONTEXT_SUSPECT_S = 30.0  # longer than Serve's replacement of a replica (6-21 s here)
CONTEXT_POLL_S = 0.1
NUM_REMEMBERED_PATHS = 10_000
# A replica that died or cannot be reached (RayActorError covers ActorDiedError and
# ActorUnavailableError), or a deployment with no replica to take the call.
UNAVAILABLE_ERRORS = (RayActorError, DeploymentUnavailableError, ReplicaUnavailableError)


def is_unavailable(exc: BaseException) -> bool:
    """Whether a call failed because its replica is gone, not because of what it was asked.

    A RayTaskError is the callee's own exception (bad input, a bug), even when its class
    also derives from the cause's (Ray subclasses both): never an unavailable replica.
    """
    return isinstance(exc, UNAVAILABLE_ERRORS) and not isinstance(exc, RayTaskError)


def _cancel_opening(opening: asyncio.Task) -> None:
    """The consumer left right after token 0: cancel the generation call, opened or not yet."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result().cancel()


async def relay(stream: DeploymentResponseGenerator, spliced_onto: RequestUpdate | None = None
                ) -> AsyncIterator[RequestUpdate]:
    """Yield the stream's updates, the first of them spliced onto ``spliced_onto`` (the handed-over
    outputs, which the caller already sent); the stream's call is cancelled if the consumer leaves
    before its finish."""
    is_finished, first = False, spliced_onto
    try:
        async for update in stream:
            stamp(update, "ingress_recv")
            if first is not None:
                update, first = without_first_token(first, update), None
                if not (update.new_token_ids or update.new_text or update.is_finished):
                    continue  # nothing but the handed-over outputs again
            is_finished = update.is_finished
            yield update
    finally:
        if not is_finished:
            stream.cancel()


class ServeBackend:
    """Either ``context`` and ``generation`` (disagg) or ``aggregated``; ``board``: WorkerStats."""

    def __init__(
        self,
        *,
        model_name: str,
        max_model_len: int,
        board: DeploymentHandle,
        context: DeploymentHandle | None = None,
        generation: DeploymentHandle | None = None,
        aggregated: DeploymentHandle | None = None,
        hasher: PromptHasher | None = None,
        local_prefill_max_tokens: int = 0,
    ) -> None:
        is_disagg = context is not None and generation is not None
        if is_disagg == (aggregated is not None):
            raise ValueError("pass either context and generation handles (disagg) or an aggregated handle")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.board = board
        self.context, self.generation, self.aggregated = context, generation, aggregated
        self.workers = [h for h in (context, generation, aggregated) if h is not None]
        self.hasher = hasher
        self.local_prefill_max_tokens = local_prefill_max_tokens if is_disagg else 0
        self.generation_caches = GenerationCaches(board)
        self.num_context_fallbacks = 0  # prompts prefilled on a generation replica: no context replica answered
        self.context_failed_at: float | None = None  # time.monotonic() of the latest unavailable context call
        self.paths: OrderedDict[str, str] = OrderedDict()  # request id -> its path (module docstring)

    def record_path(self, request_id: str, path: str) -> None:
        self.paths[request_id] = path
        self.paths.move_to_end(request_id)
        while len(self.paths) > NUM_REMEMBERED_PATHS:
            self.paths.popitem(last=False)

    def hint(self, request_id: str, prompt_token_ids: list[int]) -> RoutingHint:
        if self.hasher is None:
            return RoutingHint(request_id, len(prompt_token_ids))
        return self.hasher.hint(request_id, prompt_token_ids)

    def is_local_prefill(self, hint: RoutingHint) -> bool:
        """Whether a generation replica should prefill this prompt itself: its uncached part is short."""
        if self.local_prefill_max_tokens <= 0:
            return False
        self.generation_caches.start()
        uncached = hint.num_prompt_tokens - self.generation_caches.best_hit(hint)
        return uncached <= self.local_prefill_max_tokens

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestUpdate]:
        hint = self.hint(request_id, prompt_token_ids)
        if self.aggregated is not None:
            updates = relay(self.aggregated.options(stream=True).generate.remote(request_id, prompt_token_ids,
                                                                                 params, hint=hint))
        elif self.is_local_prefill(hint):
            self.record_path(request_id, "local")
            updates = relay(self._generate_local(request_id, prompt_token_ids, params, hint))
        else:
            updates = self._disagg(request_id, prompt_token_ids, params, hint)
        try:
            async for update in updates:
                yield update
        except Exception:
            self.record_path(request_id, "failed")
            raise

    def _generate_local(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                        hint: RoutingHint) -> DeploymentResponseGenerator:
        return self.generation.options(stream=True).generate_local.remote(request_id, prompt_token_ids, params,
                                                                          hint=hint)

    async def _disagg(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      hint: RoutingHint) -> AsyncIterator[RequestUpdate]:
        """Token 0 from the context side as soon as it is sampled, the rest from a generation replica."""
        prefilled = await self._prefill(request_id, prompt_token_ids, params, hint)
        if prefilled is None:
            updates = relay(self._generate_local(request_id, prompt_token_ids, params, hint))
        elif prefilled.is_finished:
            yield prefilled.first  # no generation call at all
            return
        else:
            # A task opens the generation call once the loop is free (while the consumer sends token 0):
            # the open is neither on token 0's path nor waits for the consumer's next pull.
            opening = asyncio.ensure_future(self._open_generation(prefilled.kv, prompt_token_ids, params, hint))
            try:
                yield prefilled.first
                stream = await opening
            except BaseException:
                _cancel_opening(opening)
                raise
            updates = relay(stream, spliced_onto=prefilled.first)
        async for update in updates:
            yield update

    async def _open_generation(self, kv: KVHandle, prompt_token_ids: list[int], params: SamplingParams,
                               hint: RoutingHint) -> DeploymentResponseGenerator:
        return self.generation.options(stream=True).generate.remote(
            kv, prompt_token_ids, params, hint=dataclasses.replace(hint, is_transfer=True))

    async def _prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       hint: RoutingHint) -> Prefilled | None:
        """The context side's prefill; None when no context replica could do it (then prefill locally)."""
        call = self.context.prefill.remote(request_id, prompt_token_ids, params, hint=hint)
        try:
            if not await self._accepted_in_bound(call):
                call.cancel()
                return self._fall_back(request_id, "wait bound", f"no context replica accepted it within "
                                       f"{CONTEXT_WAIT_BOUND_S} s of a context replica's failure")
            prefilled = await call
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            self.context_failed_at = time.monotonic()
            return self._fall_back(request_id, "unavailable", f"{type(exc).__name__}: {exc}")
        self.record_path(request_id, "context")
        return prefilled

    async def _accepted_in_bound(self, call) -> bool:
        """Whether a context replica accepts ``call`` before the bound of the module docstring ends;
        Serve's own wait (no bound) while no context call failed in the last CONTEXT_SUSPECT_S."""
        accepted = asyncio.ensure_future(call._fetch_future_result_async())  # Serve: assigned to a replica
        started = time.monotonic()
        try:
            while not accepted.done():
                await asyncio.wait({accepted}, timeout=CONTEXT_POLL_S)
                failed_at, now = self.context_failed_at, time.monotonic()
                if failed_at is not None and now - failed_at < CONTEXT_SUSPECT_S and not accepted.done():
                    if now - max(started, failed_at) >= CONTEXT_WAIT_BOUND_S:
                        return False
        finally:
            if not accepted.done():
                accepted.cancel()
        accepted.result()  # raises what the routing raised
        return True

    def _fall_back(self, request_id: str, reason: str, detail: str) -> None:
        self.num_context_fallbacks += 1
        self.record_path(request_id, f"fell back: {reason}")
        log.warning("context prefill of %s failed (%s); prefilling it on a generation replica", request_id, detail)
        return None

    async def abort(self, request_id: str) -> None:
        hint = RoutingHint(request_id)
        await asyncio.gather(*(h.abort.remote(request_id, hint=hint) for h in self.workers), return_exceptions=True)

    async def check_health(self) -> None:
        pings = [h.ping.remote() for h in self.workers] + [self.board.snapshot.remote()]
        await asyncio.wait_for(asyncio.gather(*pings), HEALTH_TIMEOUT_S)

    async def stats(self) -> dict:
        return {"workers": await self.board.snapshot.remote(), "context_fallbacks": self.num_context_fallbacks}

