"""app.backend's Backend over Serve deployment handles.

    hint = hasher.hint(request_id, prompt)                      (app.placement: the prompt hashed once)
    disagg:      kv = await context.prefill(request_id, prompt, params, hint=hint)
                 stream generation.generate(kv, prompt, params, hint=hint)
      short uncached part (P - best generation-side hit <= local_prefill_max_tokens):
                 stream generation.generate_local(request_id, prompt, params, hint=hint)
    aggregated:  stream aggregated.generate(request_id, prompt, params, hint=hint)

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
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from app.placement import GenerationCaches, PromptHasher
from app.routing import RoutingHint
from engine.outputs import RequestUpdate
from engine.params import SamplingParams

HEALTH_TIMEOUT_S = 10.0


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
        stream = await self._open(request_id, prompt_token_ids, params)
        is_finished = False
        try:
            async for update in stream:
                is_finished = update.is_finished
                yield update
        finally:
            if not is_finished:
                stream.cancel()

    async def _open(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> DeploymentResponseGenerator:
        hint = self.hint(request_id, prompt_token_ids)
        if self.aggregated is not None:
            return self.aggregated.options(stream=True).generate.remote(request_id, prompt_token_ids, params,
                                                                        hint=hint)
        generation = self.generation.options(stream=True)
        if self.is_local_prefill(hint):
            return generation.generate_local.remote(request_id, prompt_token_ids, params, hint=hint)
        prefill = self.context.prefill.remote(request_id, prompt_token_ids, params, hint=hint)
        try:
            kv_handle = await prefill
        except asyncio.CancelledError:
            prefill.cancel()
            raise
        return generation.generate.remote(kv_handle, prompt_token_ids, params,
                                          hint=dataclasses.replace(hint, is_transfer=True))

    async def abort(self, request_id: str) -> None:
        hint = RoutingHint(request_id)
        await asyncio.gather(*(h.abort.remote(request_id, hint=hint) for h in self.workers), return_exceptions=True)

    async def check_health(self) -> None:
        pings = [h.ping.remote() for h in self.workers] + [self.board.snapshot.remote()]
        await asyncio.wait_for(asyncio.gather(*pings), HEALTH_TIMEOUT_S)

    async def stats(self) -> dict:
        return {"workers": await self.board.snapshot.remote()}
