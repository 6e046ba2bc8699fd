"""Aggregated worker: one engine does both phases (the baseline disaggregation is compared to)."""

from __future__ import annotations

from typing import AsyncIterator

import torch

from actors.config import WorkerConfig
from actors.engine_loop import EngineLoop
from engine import LLMEngine, RequestUpdate, SamplingParams


class AggregatedWorker:
    def __init__(self, config: WorkerConfig | None = None) -> None:
        self.config = config or WorkerConfig()
        torch.set_num_threads(self.config.torch_threads)
        self.engine = LLMEngine(self.config.engine, role="both")
        self.loop = EngineLoop(self.engine)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        self.loop.start()
        async for update in self.loop.generate(request_id, prompt_token_ids, params):
            yield update

    async def abort(self, request_id: str) -> bool:
        return await self.loop.abort(request_id)

    async def stats(self) -> dict:
        stats = await self.loop.call(self.engine.stats)
        return {"role": "aggregated", **stats}

    async def check_integrity(self) -> None:
        await self.loop.call(self.engine.manager.check_integrity)
