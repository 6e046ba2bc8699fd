"""Start real context/generation workers as Ray actors and drive requests through them."""

from __future__ import annotations

import asyncio
import random

import ray

from actors.aggregated_worker import AggregatedWorker
from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from engine import SamplingParams

RemoteContext = ray.remote(num_cpus=0)(ContextWorker)
RemoteGeneration = ray.remote(num_cpus=0)(GenerationWorker)
RemoteAggregated = ray.remote(num_cpus=0)(AggregatedWorker)


def started(*actors) -> list:
    """Start workers made as Ray actors (whoever creates a worker starts it, once), all at once."""
    ray.get([actor.start.remote() for actor in actors])
    return list(actors)


def worker_config(transport: str = "nixl", **fields) -> WorkerConfig:
    fields.setdefault("tokens_per_block", 8)
    fields.setdefault("device", "cpu")
    return WorkerConfig(transport=transport, **fields)


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """Shorter and longer than the 32-token window, crossing 8-token blocks, some repetitive."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.choice([1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40, 63, 64, 65, 100])
        if i % 3 == 0:
            unit = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
            prompts.append((unit * length)[:length])
        else:
            prompts.append([rng.randrange(256) for _ in range(length)])
    return prompts


async def disagg_request(ctx, gen, request_id: str, prompt: list[int], params: SamplingParams, handle=None) -> list[int]:
    """Prefill on ``ctx`` (unless a handle is given), decode on ``gen``; the generated tokens."""
    if handle is None:
        handle = await ctx.prefill.remote(request_id, prompt, params)
    tokens = []
    async for ref in gen.generate.remote(handle, prompt, params):
        update = await ref
        tokens += update.new_token_ids
        if update.finish_reason == "error":
            raise RuntimeError(update.error)
    return tokens

