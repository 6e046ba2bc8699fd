"""app.backend's Backend over Serve deployment handles.

    disagg:      kv = await context.prefill(request_id, prompt, params)
                 stream generation.generate(kv, prompt, params)
    aggregated:  stream aggregated.generate(request_id, prompt, params)

A request left before its finish (client gone) has its in-flight call
cancelled: Serve cancels the replica's task, whose worker stream aborts the
request and frees its pages. ``abort`` also asks every worker deployment to
abort the id, best effort: a handle call reaches one replica of each, which
is the right one only when there is one (with more, cancellation and the
context side's lease expiry do the freeing).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

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
    ) -> None:
        is_disagg = context is not None and generation is not None
        if is_disagg == (aggregated is not None):
            raise ValueError("pass either context and generation handles (disagg) or an aggregated handle")
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.board = board
        self.context, self.generation, self.aggregated = context, generation, aggregated
        self.workers = [h for h in (context, generation, aggregated) if h is not None]

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
        if self.aggregated is not None:
            return self.aggregated.options(stream=True).generate.remote(request_id, prompt_token_ids, params)
        prefill = self.context.prefill.remote(request_id, prompt_token_ids, params)
        try:
            kv_handle = await prefill
        except asyncio.CancelledError:
            prefill.cancel()
            raise
        return self.generation.options(stream=True).generate.remote(kv_handle, prompt_token_ids, params)

    async def abort(self, request_id: str) -> None:
        await asyncio.gather(*(h.abort.remote(request_id) for h in self.workers), return_exceptions=True)

    async def check_health(self) -> None:
        pings = [h.ping.remote() for h in self.workers] + [self.board.snapshot.remote()]
        await asyncio.wait_for(asyncio.gather(*pings), HEALTH_TIMEOUT_S)

    async def stats(self) -> dict:
        return {"workers": await self.board.snapshot.remote()}
