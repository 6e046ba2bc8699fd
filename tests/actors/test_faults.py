"""Faults between real workers: a dead peer, a failed transfer. Errors are clear
and bounded in time, and no page is leaked on the side that survives."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

from bench.common import start_ray
from engine import SamplingParams
from tests.actors.disagg_helpers import (
    RemoteContext,
    RemoteGeneration,
    disagg_request,
    started,
    worker_config,
)

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session():
    start_ray(num_cpus=2)
    yield
    ray.shutdown()


async def all_free(worker) -> bool:
    await worker.check_integrity.remote()
    stats = await worker.stats.remote()
    return stats["num_free_pages"] == stats["num_total_pages"]


def test_context_dies_between_prefill_and_transfer(ray_session):
    doomed, spare, gen = started(RemoteContext.remote(worker_config()), RemoteContext.remote(worker_config()),
                                 RemoteGeneration.remote(worker_config(transfer_timeout_s=3.0)))

    async def main():
        prompt = list(range(40))
        handle = (await doomed.prefill.remote("x", prompt, GREEDY)).kv
        ray.kill(doomed)
        start = time.monotonic()
        with pytest.raises(Exception, match="did not answer|not found|TransferError|gone|Control"):
            await disagg_request(None, gen, "x", prompt, GREEDY, handle=handle)
        took = time.monotonic() - start
        # the generation worker keeps serving with another context worker
        tokens = await disagg_request(spare, gen, "y", prompt, GREEDY)
        return took, tokens, await all_free(gen), await all_free(spare)

    took, tokens, gen_free, spare_free = asyncio.run(main())
    assert took < 10, f"the error took {took:.1f}s"
    assert len(tokens) == GREEDY.max_tokens
    assert gen_free and spare_free


def test_generation_dies_before_transfer_and_the_lease_frees_context_pages(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config(lease_s=1.0)),
                       RemoteGeneration.remote(worker_config()))

    async def main():
        handle = (await ctx.prefill.remote("z", list(range(50)), GREEDY)).kv
        ray.kill(gen)
        held = not await all_free(ctx)
        await asyncio.sleep(2.0)
        return handle, held, await all_free(ctx)

    handle, held, freed = asyncio.run(main())
    assert held and freed


def test_failed_transfer_is_clear_and_frees_both_sides(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config()), RemoteGeneration.remote(worker_config()))

    async def main():
        prompt = list(range(40))
        handle = (await ctx.prefill.remote("bad", prompt, GREEDY)).kv
        broken = dict(handle.block_ordinals)
        broken["full"] = [10_000] * len(broken["full"])  # pages the context side does not have
        with pytest.raises(Exception, match="TransferError|outside|range|pages"):
            broken_handle = dataclasses.replace(handle, block_ordinals=broken)
            await disagg_request(None, gen, "bad", prompt, GREEDY, handle=broken_handle)
        await asyncio.sleep(0.3)  # the release notification reaches the context worker
        return await all_free(ctx), await all_free(gen)

    assert asyncio.run(main()) == (True, True)
