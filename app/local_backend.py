"""app.backend's Backend over the engine worker of this very replica (``engine_in_ingress``).

    proxy ──gRPC──► Ingress replica: HTTP API ──► LocalBackend ──► AggregatedWorker's engine loop
                                                  (same process, same event loop: no Serve hop a token)

An aggregated server's tokens otherwise cross a second Serve stream (worker replica -> ingress
replica), whose CPU runs on the cores that compute the next step (docs/benchmarks.md, issue 29). Here
the ingress replica is the worker: ``app.serve_app.EngineIngress`` is an ``AggregatedReplica`` too
(stats pushed to the board, ``abort``, ``ping``), and this backend reads its worker's updates in
process. Scaling adds ingress replicas, each with its own engine, spread by Serve's proxy (no
KV-aware placement: that router picks worker replicas behind an ingress, and here there are none).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from ray.serve.handle import DeploymentHandle

from engine.outputs import RequestUpdate, stamp
from engine.params import SamplingParams

if TYPE_CHECKING:
    from app.serve_workers import AggregatedReplica

HEALTH_TIMEOUT_S = 10.0


class LocalBackend:
    """The worker of ``replica`` (an aggregated one), in this process; ``board``: WorkerStats."""

    def __init__(self, replica: AggregatedReplica, *, model_name: str, max_model_len: int,
                 board: DeploymentHandle) -> None:
        self.replica = replica
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.board = board

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        """The worker's updates; a consumer that leaves closes the worker's stream (abort, pages freed)."""
        updates = self.replica.generate(request_id, prompt_token_ids, params)
        async with contextlib.aclosing(updates):
            async for update in updates:
                stamp(update, "ingress_recv")
                yield update

    async def abort(self, request_id: str) -> None:
        await self.replica.worker.abort(request_id)

    async def check_health(self) -> None:
        """The engine loop answers (it runs the call between steps) and the board is up."""
        await asyncio.wait_for(asyncio.gather(self.replica.worker.stats(), self.board.snapshot.remote()),
                               HEALTH_TIMEOUT_S)

    async def stats(self) -> dict:
        return {"workers": await self.board.snapshot.remote(), "context_fallbacks": 0}
