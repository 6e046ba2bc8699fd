"""Aggregated worker: one engine does both phases (the baseline disaggregation is compared to)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from actors.worker_base import EngineWorker
from engine import RequestUpdate, SamplingParams


class AggregatedWorker(EngineWorker):
    role = "both"

    async def stats(self) -> dict:
        return {**await super().stats(), "role": "aggregated"}

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestUpdate]:
        async for update in self.loop.generate(request_id, prompt_token_ids, params):
            yield update
