"""Prefix caching across the transfer, between real Ray actors over real NIXL.

Geometry (windserve-tiny, ``worker_config``): ``B = 8``, a full group and a
sliding group with ``W = 32``. For a prompt of ``P`` tokens the slice is
ordinals ``[stale_end(N), ceil(N/B))``, ``N = num_kv_tokens`` (the prompt, and
the outputs but the last of a multi-token handoff: ``engine.handoff``); the
generation side pulls only those its own cache lacks, so bytes moved = pulled
ordinals x page size.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch

from actors.generation_worker import GenerationWorker
from bench.common import start_ray
from engine import SamplingParams
from kvcache import stale_end
from tests.actors.disagg_helpers import (
    RemoteContext,
    RemoteGeneration,
    disagg_request,
    disagg_usage,
    free_pages,
    run_in_order,
    started,
    worker_config,
)
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
B, WINDOW = 8, {"full": None, "sliding": 32}


@ray.remote(num_cpus=0)
class SlowPullGeneration(GenerationWorker):
    """Its reads start late, so an abort can arrive while one is in flight."""

    def _read(self, peer, runs):
        time.sleep(1.0)
        return super()._read(peer, runs)


@pytest.fixture(scope="module")
def ray_session():
    start_ray(num_cpus=2)
    yield
    ray.shutdown()


def slice_ordinals(group: str, N: int) -> range:
    return range(stale_end(N, WINDOW[group], B), -(-N // B))


async def page_bytes(worker) -> dict[str, int]:
    pages = {g: await worker.read_pages.remote(g, [0]) for g in WINDOW}
    return {g: t[0].numel() * t[0].element_size() for g, t in pages.items()}


async def slice_pages(worker, tables: dict[str, list[int]], N: int) -> dict[str, torch.Tensor]:
    """The pages at every slice ordinal of ``tables``, in ordinal order."""
    return {g: await worker.read_pages.remote(g, [tables[g][i] for i in slice_ordinals(g, N)]) for g in WINDOW}


async def pull(ctx, gen, rid: str, prompt: list[int]):
    """Prefill on ``ctx``, then only the handoff on ``gen``: its ReadStats, and whether every page
    at a slice ordinal on ``gen`` (pulled or reused) holds what the context side holds there."""
    handle = (await ctx.prefill.remote(rid, prompt, GREEDY)).kv
    want = await slice_pages(ctx, handle.block_ordinals, handle.num_kv_tokens)
    stats = await gen.receive_kv.remote(handle, prompt)
    got = await slice_pages(gen, await gen.block_ordinals.remote(rid), handle.num_kv_tokens)
    await gen.abort.remote(rid)
    return stats, all(torch.equal(got[g], want[g]) and want[g].abs().sum() > 0 for g in WINDOW)


async def moved(gen, request) -> tuple[int, tuple[list[int], int]]:
    """KV bytes the generation worker pulled while ``request`` ran, and what it returned."""
    before = (await gen.stats.remote())["kv_transfer_bytes"]
    result = await request
    return (await gen.stats.remote())["kv_transfer_bytes"] - before, result


def test_bytes_moved_are_the_slice_blocks_the_generation_side_lacks(ray_session, tiny_model):
    ctx, gen = started(RemoteContext.remote(worker_config()), RemoteGeneration.remote(worker_config()))
    repeated = [(7 * i) % 251 for i in range(70)]        # 8 full blocks and 6 tokens
    head = [(11 * i + 3) % 251 for i in range(56)] + [1, 2, 3, 4]
    forked = head[:56] + list(range(200, 219))           # P = 75: shares 56 tokens (blocks 0..6)

    async def main():
        size = await page_bytes(gen)
        usage = [await disagg_usage(ctx, gen, "a0", repeated, GREEDY)]
        again = await pull(ctx, gen, "a1", repeated)
        num_bytes = {}
        num_bytes["repeated"], result = await moved(gen, disagg_usage(ctx, gen, "a2", repeated, GREEDY))
        usage += [result, await disagg_usage(ctx, gen, "h0", head, GREEDY)]
        num_bytes["forked"], result = await moved(gen, disagg_usage(ctx, gen, "h1", forked, GREEDY))
        await asyncio.sleep(0.2)  # the last release reaches the context worker
        return size, again, num_bytes, usage + [result], await free_pages(ctx, gen)

    size, (again, intact), num_bytes, usage, pages = asyncio.run(main())
    # Repeated prompt, P = 70 (k = 2: N = 71): blocks 0..7 are held (full 0..7; window 5..7 from
    # stale_end(71) = 5); only ordinal 8, the partial last block (tokens 64..70), travels, in each group.
    assert again.num_bytes == num_bytes["repeated"] == size["full"] + size["sliding"]
    assert intact, "a page at a slice ordinal, pulled or reused, differs from the context's"
    # Forked prompt, P = 75 (k = 2: N = 76), shares blocks 0..6: the slice is full 0..9 and window 5..9;
    # 0..6 and 5..6 are held, so ordinals 7, 8, 9 travel in each group.
    assert num_bytes["forked"] == 3 * (size["full"] + size["sliding"])
    expected = run_in_order(make_engine(tiny_model, tokens_per_block=8), [repeated, repeated, head, forked], GREEDY)
    assert usage == expected  # tokens, and the prompt tokens reported cached
    assert [cached for _, cached in usage] == [0, 64, 0, 56]  # the context side's hits, by positions
    assert all(free == total for free, total in pages), pages


def test_an_abort_mid_transfer_leaves_a_shared_prefix_intact_for_the_others(ray_session, tiny_model):
    """A, B, C share 64 prompt tokens, whose pages the context side shares between their leases.
    A is aborted while its read is in flight; D then takes every page the context side can give,
    evicting whatever A's end freed. B's pull still brings the context's prefill of B at every
    slice ordinal, and C's tokens equal the aggregated ones."""
    ctx, gen = started(RemoteContext.remote(worker_config(num_pages=48)), SlowPullGeneration.remote(worker_config()))
    shared = [(5 * i + 1) % 251 for i in range(64)]
    prompts = {name: shared + [tail + i for i in range(16)] for name, tail in (("A", 100), ("B", 140), ("C", 180))}

    async def main():
        handles = {name: (await ctx.prefill.remote(name, prompt, GREEDY)).kv for name, prompt in prompts.items()}
        want_b = await slice_pages(ctx, handles["B"].block_ordinals, handles["B"].num_kv_tokens)
        job = asyncio.ensure_future(disagg_request(ctx, gen, "A", prompts["A"], GREEDY, handles["A"]))
        while (await ctx.stats.remote())["num_claimed_leases"] == 0 and not job.done():
            await asyncio.sleep(0.001)
        await gen.abort.remote("A")
        with pytest.raises(ray.exceptions.TaskCancelledError):  # its handoff was cancelled, read in flight
            await job
        while (await ctx.stats.remote())["num_leases"] == 3:
            await asyncio.sleep(0.01)  # A's release reaches the context worker
        # The full group's free pages: 48 - (8 shared + those of B and C alone); D takes all of them.
        # max_tokens=2: a request that ends at its first token gives its pages back at once
        num_free = 48 - len({page for name in "BC" for page in handles[name].block_ordinals["full"]})
        await ctx.prefill.remote("D", [(3 * i) % 7 + 240 for i in range(num_free * B - 4)],
                                 SamplingParams(max_tokens=2, ignore_eos=True))
        await gen.receive_kv.remote(handles["B"], prompts["B"])
        got_b = await slice_pages(gen, await gen.block_ordinals.remote("B"), handles["B"].num_kv_tokens)
        tokens_c = await disagg_request(ctx, gen, "C", prompts["C"], GREEDY, handles["C"])
        await gen.abort.remote("B")
        await ctx.abort.remote("D")
        await asyncio.sleep(0.2)
        return handles, want_b, got_b, tokens_c, await free_pages(ctx, gen)

    handles, want_b, got_b, tokens_c, pages = asyncio.run(main())
    tables = {name: handle.block_ordinals["full"] for name, handle in handles.items()}
    assert tables["A"][:8] == tables["B"][:8] == tables["C"][:8]  # one page per shared block, all three leases
    assert handles["B"].num_cached_tokens == handles["C"].num_cached_tokens == 64
    for group in WINDOW:
        assert torch.equal(got_b[group], want_b[group]), f"{group}: B's pulled pages differ from its prefill"
    assert tokens_c == run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompts["C"]], GREEDY)["r0"]
    assert all(free == total for free, total in pages), pages
