"""Context on one Ray node, generation on another (two nodes on this machine)."""

from __future__ import annotations

import asyncio

import pytest
import ray
from ray.cluster_utils import Cluster

from bench.common import start_ray
from engine import SamplingParams
from tests.actors.disagg_helpers import (
    RemoteContext,
    RemoteGeneration,
    disagg_request,
    random_prompts,
    slice_bytes,
    started,
    worker_config,
)
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"context_node": 1}})
    cluster.add_node(num_cpus=1, resources={"generation_node": 1})
    start_ray(address=cluster.address)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))


def test_context_and_generation_on_different_nodes(two_nodes, tiny_model):
    """The tokens equal the aggregated ones, and every request's KV crossed between the nodes: one read
    per request, no local prefill (a fallback would give the same tokens), and exactly the bytes of
    each request's windowed slice (the prompts share no block, so the generation side reuses none)."""
    on_context_node = RemoteContext.options(resources={"context_node": 0.5})
    on_generation_node = RemoteGeneration.options(resources={"generation_node": 0.5})
    ctx, gen = started(on_context_node.remote(worker_config()),
                       on_generation_node.remote(worker_config(max_draft_len=2)))
    assert node_of(ctx) != node_of(gen)
    prompts = random_prompts(12, seed=11)
    reference = make_engine(tiny_model, tokens_per_block=8)
    expected = run_to_completion(reference, prompts, GREEDY)

    async def one(i, prompt):
        handle = (await ctx.prefill.remote(f"n{i}", prompt, GREEDY)).kv
        return handle, await disagg_request(ctx, gen, f"n{i}", prompt, GREEDY, handle=handle)

    async def main():
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    results = asyncio.run(main())
    for i, (_, tokens) in enumerate(results):
        assert tokens == expected[f"r{i}"], f"request {i} differs across nodes"
    stats = ray.get(gen.stats.remote())
    assert (stats["num_transfer_fallbacks"], stats["kv_transfers"]) == (0, len(prompts))
    assert stats["kv_transfer_bytes"] == sum(slice_bytes(reference.manager, h.num_kv_tokens) for h, _ in results) > 0
    for worker in (ctx, gen):
        stats = ray.get(worker.stats.remote())
        assert stats["num_free_pages"] == stats["num_total_pages"]
