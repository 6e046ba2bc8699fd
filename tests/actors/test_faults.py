"""Faults between real workers: a dead peer, a failed transfer. A context side that dies
or lets its lease lapse under a handoff costs the request nothing (the generation worker
prefills it, keeping the k outputs the context side handed over); other errors are clear and bounded in time, and no
page is leaked on the side that survives."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest
import ray
import torch

from actors.generation_worker import GenerationWorker
from actors.peers import PeerDirectory, lookup
from actors.transport import LocalFabric, PageRun, make_transport, unique_agent_name
from bench.common import start_ray
from engine import SamplingParams
from tests.actors.disagg_helpers import (
    RemoteContext,
    RemoteGeneration,
    client_stream,
    disagg_request,
    held_back_prompts,
    started,
    worker_config,
)
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
CLAIM_TIMEOUT_S = 3.0  # a live context side answers in ms; room for a loaded machine
PAUSE_S = 60.0  # at most: the test resumes the read once the context actor is gone


@pytest.fixture(scope="module")
def ray_session():
    start_ray(num_cpus=2)
    yield
    ray.shutdown()


async def kill_and_wait(actor) -> None:
    """``ray.kill`` and wait until the actor's process is gone. Ray fails calls to a killed actor at
    once, but its process (and the NIXL agent serving its pages) can outlive that for a while on a
    loaded machine: a read right after the kill could still succeed."""
    pid = await actor.__ray_call__.remote(lambda self: os.getpid())
    ray.kill(actor)
    for _ in range(600):
        if not os.path.exists(f"/proc/{pid}"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the killed actor's process {pid} is still there after 30 s")


async def all_free(worker) -> bool:
    await worker.check_integrity.remote()
    stats = await worker.stats.remote()
    return stats["num_free_pages"] == stats["num_total_pages"]


def test_context_killed_before_the_pull_falls_back_and_a_replacement_transfers(ray_session, tiny_model):
    """Handles in hand, the context actor is killed (the generation worker was connected to it):
    each stream completes from a local prefill with the aggregated tokens, greedy and seeded; the
    dead peer is dropped; a new context actor then serves the next request by a real transfer."""
    prompts = {"g": list(range(40)), "s": [(3 * i) % 256 for i in range(29)], "w": list(range(60, 90)),
               "n": list(range(100, 137))}
    params = {"g": GREEDY, "s": SEEDED, "w": GREEDY, "n": GREEDY}
    expected = {rid: run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompts[rid]], params[rid])["r0"]
                for rid in prompts}
    doomed, gen = started(RemoteContext.remote(worker_config()),
                          RemoteGeneration.remote(worker_config(claim_timeout_s=CLAIM_TIMEOUT_S)))

    async def main():
        out = {"w": await disagg_request(doomed, gen, "w", prompts["w"], GREEDY)}  # connected to it now
        agent = (await doomed.stats.remote())["agent"]
        handles = {rid: (await doomed.prefill.remote(rid, prompts[rid], params[rid])).kv for rid in ("g", "s")}
        await kill_and_wait(doomed)
        start = time.monotonic()
        out.update(zip(handles, await asyncio.gather(
            *[disagg_request(None, gen, rid, prompts[rid], params[rid], handle=h) for rid, h in handles.items()])))
        took = time.monotonic() - start
        after_kill = await gen.stats.remote()
        connected = await is_connected(gen, agent)
        spare = started(RemoteContext.remote(worker_config()))[0]
        out["n"] = await disagg_request(spare, gen, "n", prompts["n"], GREEDY)
        return out, took, after_kill, connected, await gen.stats.remote(), await all_free(gen), await all_free(spare)

    out, took, after_kill, connected, final, gen_free, spare_free = asyncio.run(main())
    assert out == expected
    assert took < CLAIM_TIMEOUT_S + 5, f"the fallback took {took:.1f}s"
    assert (after_kill["num_transfer_fallbacks"], after_kill["kv_transfers"]) == (2, 1)
    assert not connected
    assert (final["num_transfer_fallbacks"], final["kv_transfers"]) == (2, 2)  # the replacement: a real pull
    assert gen_free and spare_free


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
                                    dataclasses.replace(SEEDED, logprobs=2)], ids=["greedy", "seeded"])
def test_context_killed_after_a_multi_token_handoff_streams_the_aggregated_tokens(ray_session, tiny_model, params):
    """Token 0 held back: the context side handed over k > 1 outputs, then died before the pull.
    The generation worker resumes with those k (its first update repeats them, as a transfer's
    does): the client's stream is the aggregated one, tokens and logprobs, each output once."""
    cases = held_back_prompts(tiny_model, params, n=2)
    doomed, gen = started(RemoteContext.remote(worker_config()),
                          RemoteGeneration.remote(worker_config(claim_timeout_s=CLAIM_TIMEOUT_S)))

    async def main():
        prefilled = [await doomed.prefill.remote(f"k{i}", case[0], params) for i, case in enumerate(cases)]
        await kill_and_wait(doomed)
        streams = [await client_stream(gen, p, case[0], params) for p, case in zip(prefilled, cases)]
        return prefilled, streams, await gen.stats.remote(), await all_free(gen)

    prefilled, streams, stats, gen_free = asyncio.run(main())
    for (_, k, tokens, logprobs), handed, stream in zip(cases, prefilled, streams):
        assert k > 1 and handed.first.new_token_ids == tokens[:k]
        assert [t for u in stream for t in u.new_token_ids] == tokens
        assert [lp for u in stream for lp in u.logprobs] == logprobs
    assert (stats["num_transfer_fallbacks"], stats["kv_transfers"]) == (len(cases), 0)
    assert gen_free


class PauseBeforePull(GenerationWorker):
    """A generation worker that waits between its granted Claim and its read until ``resume``
    (a test's window to kill the context side)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self._resume = asyncio.Event()

    async def resume(self) -> None:
        self._resume.set()

    async def _pull(self, handoff, handle):
        await asyncio.wait_for(self._resume.wait(), PAUSE_S)
        return await super()._pull(handoff, handle)


def test_context_killed_between_claim_and_read_falls_back(ray_session, tiny_model):
    prompt = list(range(50))
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompt], SEEDED)["r0"]
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       ray.remote(num_cpus=0)(PauseBeforePull).remote(worker_config(transfer_timeout_s=5.0)))

    async def main():
        agent = (await ctx.stats.remote())["agent"]
        handle = (await ctx.prefill.remote("k", prompt, SEEDED)).kv
        job = asyncio.ensure_future(disagg_request(None, gen, "k", prompt, SEEDED, handle=handle))
        while (await ctx.stats.remote())["num_claimed_leases"] == 0:
            await asyncio.sleep(0.02)
        await kill_and_wait(ctx)  # claimed, not yet read
        await gen.resume.remote()
        start = time.monotonic()
        tokens = await asyncio.wait_for(job, 60)
        return tokens, time.monotonic() - start, await gen.stats.remote(), await is_connected(gen, agent), \
            await all_free(gen)

    tokens, took, stats, connected, gen_free = asyncio.run(main())
    assert tokens == expected
    assert (stats["num_transfer_fallbacks"], stats["kv_transfers"]) == (1, 0)
    assert took < 5.0 + 5, f"the fallback took {took:.1f}s"  # the read's own timeout (5 s) bounds it
    assert not connected and gen_free


def test_context_killed_while_the_request_waits_for_generation_pages_falls_back(ray_session, tiny_model):
    """The generation cache is full ("a"'s received pages, held until aborted): "b" waits for pages,
    extending its lease on the context side. The context actor dies; "b"'s next extension finds it
    gone and "b" falls back: prefilled here once "a" is aborted, with the tokens the context side
    would have given. Before, the failed extension reached the client as an error."""
    prompts = {"a": list(range(72)), "b": [(5 * i) % 256 for i in range(44)]}  # a: 9 of 14 pages, b: 6
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompts["b"]], SEEDED)["r0"]
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       RemoteGeneration.remote(worker_config(num_pages=14, max_model_len=96,
                                                             claim_timeout_s=CLAIM_TIMEOUT_S)))

    async def main():
        handles = {rid: (await ctx.prefill.remote(rid, prompts[rid], SEEDED)).kv for rid in prompts}
        await gen.receive_kv.remote(handles["a"], prompts["a"])  # "a"'s pages stay bound
        job = asyncio.ensure_future(disagg_request(None, gen, "b", prompts["b"], SEEDED, handle=handles["b"]))
        in_handoff = lambda self: list(self._handoffs)  # noqa: E731
        for _ in range(200):
            if await gen.__ray_call__.remote(in_handoff) == ["b"]:
                break
            await asyncio.sleep(0.02)
        waiting_at_kill = await gen.__ray_call__.remote(in_handoff)
        await kill_and_wait(ctx)
        await asyncio.sleep(1.0)  # extensions go on every 50 ms, now to a dead peer
        still_waiting = not job.done()
        await gen.abort.remote("a")
        tokens = await asyncio.wait_for(job, 60)
        return tokens, waiting_at_kill, still_waiting, await gen.stats.remote(), await all_free(gen)

    tokens, waiting_at_kill, still_waiting, stats, gen_free = asyncio.run(main())
    assert waiting_at_kill == ["b"] and still_waiting  # the kill hit "b" waiting for pages; it did not fail
    assert tokens == expected
    assert (stats["num_transfer_fallbacks"], stats["kv_transfers"]) == (1, 1)
    assert gen_free


def test_lapsed_lease_falls_back_with_the_same_tokens(ray_session, tiny_model):
    prompt = list(range(40))
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompt], SEEDED)["r0"]
    ctx, gen = started(RemoteContext.remote(worker_config(lease_s=0.5)), RemoteGeneration.remote(worker_config()))

    async def main():
        handle = (await ctx.prefill.remote("late", prompt, SEEDED)).kv
        await asyncio.sleep(1.5)  # the lease lapses, the reaper frees the pages
        tokens = await disagg_request(None, gen, "late", prompt, SEEDED, handle=handle)
        agent = handle.context_agent
        return tokens, await gen.stats.remote(), await is_connected(gen, agent), await all_free(gen), \
            await all_free(ctx)

    tokens, stats, connected, gen_free, ctx_free = asyncio.run(main())
    assert tokens == expected
    assert (stats["num_transfer_fallbacks"], stats["kv_transfers"]) == (1, 0)
    assert connected  # it answered (refused): alive, so its connection is kept
    assert gen_free and ctx_free


def test_a_peer_republished_under_the_same_name_is_reconnected(ray_session):
    """A replacement publishes new metadata under a name we are connected to: ``ensure_current``
    reconnects, and a read lands the replacement's pages, not reads through the old metadata."""
    name, compat = unique_agent_name("ctx"), {"model": "m"}
    reader = make_transport("local", unique_agent_name("gen"), fabric=LocalFabric())
    reader.register({"full": torch.zeros(4, 8)})
    peers = PeerDirectory(reader, compat)
    old = make_transport("local", name, fabric=reader.fabric)
    old.register({"full": torch.full((4, 8), 1.0)})
    PeerDirectory(old, compat).publish()
    peers.ensure_current(name, lookup(name))
    first = reader.peers[name]
    old.close()
    new = make_transport("local", name, fabric=reader.fabric)
    new.register({"full": torch.full((6, 8), 2.0)})  # a new process: new regions
    PeerDirectory(new, compat).publish()
    peers.ensure_connected(name)  # the cached connection: no look-up
    assert reader.peers[name] == first
    peers.ensure_current(name, lookup(name))
    assert reader.peers[name] != first and reader.peers[name].regions["full"].num_pages == 6
    reader.read(name, [PageRun("full", 5, 0, 1)])
    assert reader.tensors["full"][0].eq(2.0).all()
    peers.forget(name)
    assert not peers.is_connected(name) and not reader.is_connected(name)
    PeerDirectory(new, compat).unpublish()


async def is_connected(worker, agent: str) -> bool:
    return await worker.__ray_call__.remote(lambda self: self.peers.is_connected(agent)
                                            or self.transport.is_connected(agent))


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
