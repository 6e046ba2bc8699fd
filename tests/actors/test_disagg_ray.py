"""Disaggregated serving across real Ray actors over real NIXL."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
import torch

from actors.leases import LeaseDenied
from actors.peers import PeerNotFoundError, lookup
from bench.common import start_ray
from engine import SamplingParams
from kvcache import slice_range
from tests.actors.disagg_helpers import (
    RemoteContext,
    RemoteGeneration,
    client_stream,
    disagg_request,
    free_pages,
    held_back_prompts,
    prompts_sharing_prefixes,
    random_prompts,
    started,
    transfer_counts,
    worker_config,
)
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401
from tests.engine.test_handoff import CANDIDATES

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_session():
    start_ray(num_cpus=2)
    yield
    ray.shutdown()


def assert_all_free(pages):
    assert all(free == total for free, total in pages), pages


def test_disaggregated_equals_aggregated(ray_session, tiny_model):
    """50 requests in two waves; the second repeats, forks or extends the first's prompts, so
    both sides' prefix caches hit (the context side skips computing, the generation side pulling)."""
    first, second = prompts_sharing_prefixes(50, seed=3)
    prompts = first + second
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, GREEDY)
    contexts = started(*[RemoteContext.remote(worker_config(num_extra_kv_tokens=e)) for e in (0, 2)])
    generations = started(*[RemoteGeneration.remote(worker_config(max_draft_len=d, num_extra_kv_tokens=e))
                            for d, e in [(0, 2), (1, 0), (2, 2), (3, 0), (4, 2)]])

    def job(i: int):  # a second-wave prompt goes where the first-wave prompt it derives from went
        family = i % len(first)
        return disagg_request(contexts[family % 2], generations[family % 5], f"q{i}", prompts[i], GREEDY)

    async def main():
        results = await asyncio.gather(*[job(i) for i in range(len(first))])
        results += await asyncio.gather(*[job(i) for i in range(len(first), len(prompts))])
        stats = [await worker.stats.remote() for worker in (*contexts, *generations)]
        return results, stats, await transfer_counts(*generations), await free_pages(*contexts, *generations)

    results, stats, transfers, pages = asyncio.run(main())
    for i, tokens in enumerate(results):
        assert tokens == expected[f"r{i}"], f"request {i} (prompt {len(prompts[i])} tokens) differs"
    handoffs = [sum(1 for i in range(len(prompts)) if i % len(first) % 5 == g) for g in range(5)]
    assert transfers == [(0, n) for n in handoffs]  # every request's KV pulled, none prefilled again
    assert sum(s["kv_transfer_bytes"] for s in stats if s["role"] == "generation") > 0
    for role in ("context", "generation"):
        assert sum(s["prefix_cache_hits"] for s in stats if s["role"] == role) > 0, f"no {role} worker hit its cache"
    assert all(s["prefix_cache_queries"] >= s["prefix_cache_hits"] and "num_cached_blocks" in s for s in stats)
    assert_all_free(pages)


def test_seeded_sampling_disaggregated_equals_aggregated(ray_session, tiny_model):
    """Draws depend on (seed, output index) only, so the context worker sampling the
    first token and the generation worker the rest gives the aggregated tokens."""
    prompts = random_prompts(6, seed=5)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, params)
    ctx, gen = started(RemoteContext.remote(worker_config()), RemoteGeneration.remote(worker_config()))

    async def main():
        results = await asyncio.gather(*[disagg_request(ctx, gen, f"s{i}", p, params[i])
                                         for i, p in enumerate(prompts)])
        return results, await transfer_counts(gen)

    results, transfers = asyncio.run(main())
    for i, tokens in enumerate(results):
        assert tokens == expected[f"r{i}"]
    assert transfers == [(0, len(prompts))]


def test_penalties_disaggregated_equal_aggregated(ray_session, tiny_model):
    """logit_bias, min_tokens and the repetition penalty over the prompt apply to the context worker's
    first token; the drafting generation worker counts the handed-over tokens in its penalties: the
    aggregated tokens, and the bias moved the first token."""
    prompts = random_prompts(4, seed=7)
    plain = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, GREEDY)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.2, frequency_penalty=-0.4,
                             presence_penalty=0.3, logit_bias={plain[f"r{i}"][0]: -100.0}, min_tokens=3,
                             stop_token_ids=(plain[f"r{i}"][1],)) for i in range(len(prompts))]
    expected = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, params)
    ctx, gen = started(RemoteContext.remote(worker_config()), RemoteGeneration.remote(worker_config(max_draft_len=3)))

    async def main():
        return await asyncio.gather(*[disagg_request(ctx, gen, f"p{i}", p, params[i]) for i, p in enumerate(prompts)])

    for i, tokens in enumerate(asyncio.run(main())):
        assert tokens == expected[f"r{i}"] and tokens[0] != plain[f"r{i}"][0]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2),
    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True, logprobs=2),
], ids=["greedy", "seeded"])
def test_a_held_back_token_0_hands_over_k_outputs_and_the_stream_equals_aggregated(ray_session, tiny_model, params):
    """The context worker hands over t0..t(k-1) (k > 1: up to the first visible text) in one update;
    that update, then the generation stream less its repeat of them, is the aggregated stream:
    tokens and logprobs (one request at a time, as the reference ran, so the rows are computed
    in the same shapes). On a model with a sliding-window group; pages free on both sides afterwards."""
    cases = held_back_prompts(tiny_model, params)
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       RemoteGeneration.remote(worker_config(num_extra_kv_tokens=2)))

    async def one(i, prompt):
        prefilled = await ctx.prefill.remote(f"h{i}", prompt, params)
        return prefilled, await client_stream(gen, prefilled, prompt, params)

    async def main():
        results = [await one(i, case[0]) for i, case in enumerate(cases)]
        return results, await transfer_counts(gen), await free_pages(ctx, gen)

    results, transfers, pages = asyncio.run(main())
    assert transfers == [(0, len(cases))]
    for (prompt, k, tokens, logprobs), (prefilled, stream) in zip(cases, results):
        assert prefilled.first.new_token_ids == prefilled.kv.output_token_ids == tokens[:k]
        assert prefilled.kv.num_kv_tokens == len(prompt) + k - 1
        assert [t for u in stream for t in u.new_token_ids] == tokens
        assert [lp for u in stream for lp in u.logprobs] == logprobs
    assert_all_free(pages)


def test_a_multi_token_handoff_lands_the_kv_of_its_outputs(ray_session, tiny_model):
    """The slice at N = P + k - 1 (the prompt and t0..t(k-2)): every block of it lands at its
    ordinal with the context side's rows, including the block only the outputs reach."""
    def blocks(n):
        return -(-n // 8)

    cases = held_back_prompts(tiny_model, GREEDY, n=len(CANDIDATES))
    prompt, k, _, _ = next(c for c in cases if blocks(len(c[0]) + c[1] - 1) > blocks(len(c[0])))
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       RemoteGeneration.remote(worker_config(max_draft_len=3, num_extra_kv_tokens=2)))

    async def main():
        handle = (await ctx.prefill.remote("m", prompt, GREEDY)).kv
        src = {g: await ctx.read_pages.remote(g, [max(p, 0) for p in table])
               for g, table in handle.block_ordinals.items()}
        await gen.receive_kv.remote(handle, prompt)
        checks = []
        for group, table in (await gen.block_ordinals.remote("m")).items():
            checks.append((group, table, src[group], await gen.read_pages.remote(group, [max(p, 0) for p in table])))
        await gen.abort.remote("m")
        return handle, checks, await free_pages(ctx, gen)

    handle, checks, pages = asyncio.run(main())
    N, window = handle.num_kv_tokens, {"sliding": 32, "full": None}
    assert N == len(prompt) + k - 1 and len(handle.output_token_ids) == k
    for group, dst_table, src, got in checks:
        ordinals = slice_range(N, window[group], 8)
        assert ordinals.stop == blocks(N) > blocks(len(prompt))
        for ordinal in ordinals:
            assert dst_table[ordinal] >= 0 and torch.equal(got[ordinal], src[ordinal]), f"{group} ordinal {ordinal}"
            assert got[ordinal].abs().sum() > 0
    assert_all_free(pages)


def test_pages_land_at_their_ordinals_and_nowhere_else(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       RemoteGeneration.remote(worker_config(max_draft_len=3, num_extra_kv_tokens=2)))

    async def main():
        prompt = list(range(30, 30 + 70))  # window 32, blocks of 8: stale blocks, a partial last block
        handle = (await ctx.prefill.remote("p", prompt, GREEDY)).kv
        src = {g: await ctx.read_pages.remote(g, [max(p, 0) for p in table])
               for g, table in handle.block_ordinals.items()}
        record = await gen.receive_kv.remote(handle)
        dst_tables = await gen.block_ordinals.remote("p")
        checks = []
        for group, table in dst_tables.items():
            got = await gen.read_pages.remote(group, [max(p, 0) for p in table])
            checks.append((group, handle.block_ordinals[group], table, src[group], got))
        await gen.abort.remote("p")
        return record, checks, await free_pages(ctx, gen)

    record, checks, pages = asyncio.run(main())
    B, P, window = 8, 70, {"sliding": 32, "full": None}
    expected_bytes = 0
    for group, _src_table, dst_table, src, got in checks:
        first = 0 if window[group] is None else (P + 1 - window[group]) // B
        last = -(-P // B)
        for ordinal, dst_page in enumerate(dst_table):
            if dst_page < 0:
                assert ordinal < first
                continue
            if first <= ordinal < last:
                assert torch.equal(got[ordinal], src[ordinal]), f"{group} ordinal {ordinal} holds other KV"
                assert got[ordinal].abs().sum() > 0
                expected_bytes += got[ordinal].numel() * got[ordinal].element_size()
            else:
                assert got[ordinal].abs().sum() == 0, f"{group} ordinal {ordinal} outside the slice was written"
    assert record.num_bytes == expected_bytes
    assert record.num_descriptors < record.num_pages  # adjacent pages coalesced
    assert_all_free(pages)


def test_expired_lease_fails_a_late_transfer_and_never_reads_reused_pages(ray_session):
    # 6 pages a group: "new" must take the pages "old" left (free ones go first, then cached ones are evicted).
    ctx, gen = started(RemoteContext.remote(worker_config(lease_s=0.5, num_pages=6)),
                       RemoteGeneration.remote(worker_config()))

    async def main():
        handle = (await ctx.prefill.remote("old", list(range(40)), GREEDY)).kv
        await asyncio.sleep(1.5)  # the lease lapses, the reaper frees the pages
        reuser = (await ctx.prefill.remote("new", list(range(100, 140)), GREEDY)).kv
        reused = set(handle.block_ordinals["full"]) & set(reuser.block_ordinals["full"])
        with pytest.raises(Exception, match="expired|no longer holds"):
            await disagg_request_from(handle, gen, list(range(40)))
        await ctx.abort.remote("new")
        return reused, await free_pages(ctx, gen)

    reused, pages = asyncio.run(main())
    assert reused, "the test needs the freed pages to be reused"
    assert_all_free(pages)


async def disagg_request_from(handle, gen, prompt):
    """The handoff alone: ``generate`` would fall back to a local prefill (tests/actors/test_faults.py)."""
    await gen.receive_kv.remote(handle, prompt)
    await gen.abort.remote(handle.request_id)


def test_abort_at_each_stage_frees_both_sides(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config(max_num_batched_tokens=16)),
                       RemoteGeneration.remote(worker_config()))

    async def main():
        # during prefill (chunked over several steps)
        task = asyncio.ensure_future(ctx.prefill.remote("a", [i % 256 for i in range(400)], GREEDY))
        while (await ctx.stats.remote())["num_running"] == 0:
            await asyncio.sleep(0.01)
        assert await ctx.abort.remote("a")
        with pytest.raises(RuntimeError, match="prefill of 'a' failed: abort"):
            await task
        # after prefill, before transfer
        await ctx.prefill.remote("b", list(range(50)), GREEDY)
        assert await ctx.abort.remote("b")
        # after transfer, during decode
        handle = (await ctx.prefill.remote("c", list(range(50)), GREEDY)).kv
        stream = gen.generate.remote(handle, list(range(50)), SamplingParams(max_tokens=400, ignore_eos=True))
        async for ref in stream:
            await ref
            break
        await gen.abort.remote("c")
        await asyncio.sleep(0.2)
        return await free_pages(ctx, gen)

    assert_all_free(asyncio.run(main()))


def test_generation_side_extends_the_lease_while_waiting_for_pages(ray_session):
    """The generation cache is full; the context lease (2 s) would lapse, but the
    waiting generation side extends it, and the request completes once pages free."""
    ctx, gen = started(RemoteContext.remote(worker_config(lease_s=2.0)),
                       RemoteGeneration.remote(worker_config(num_pages=12)))

    async def main():
        hog = (await ctx.prefill.remote("hog", list(range(60)), GREEDY)).kv
        await gen.receive_kv.remote(hog)  # holds its pages, not decoding, until aborted
        waiting = (await ctx.prefill.remote("late", list(range(50)), GREEDY)).kv
        job = asyncio.ensure_future(disagg_request_tokens(gen, waiting, list(range(50))))
        await asyncio.sleep(5.0)  # longer than the lease: only extensions keep it alive
        assert not job.done(), job.exception()
        await gen.abort.remote("hog")
        tokens = await asyncio.wait_for(job, 30)
        await asyncio.sleep(0.2)
        return tokens, await free_pages(ctx, gen)

    tokens, pages = asyncio.run(main())
    assert len(tokens) == GREEDY.max_tokens
    assert_all_free(pages)


async def disagg_request_tokens(gen, handle, prompt):
    tokens = []
    async for ref in gen.generate.remote(handle, prompt, GREEDY):
        tokens += (await ref).new_token_ids
    return tokens


def test_abort_while_waiting_for_pages_ends_the_handoff_and_frees_both_sides(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config()),
                       RemoteGeneration.remote(worker_config(num_pages=12)))

    async def main():
        hog = (await ctx.prefill.remote("hog", list(range(60)), GREEDY)).kv
        await gen.receive_kv.remote(hog)  # the generation cache is now too full for "late"
        late = (await ctx.prefill.remote("late", list(range(50)), GREEDY)).kv
        job = asyncio.ensure_future(disagg_request_tokens(gen, late, list(range(50))))
        await asyncio.sleep(0.5)
        assert not job.done(), job.exception()
        assert await gen.abort.remote("late")  # returns once the handoff is undone
        with pytest.raises(ray.exceptions.TaskCancelledError):  # the stream ends: its handoff was cancelled
            await asyncio.wait_for(job, 10)
        await gen.abort.remote("hog")
        await asyncio.sleep(0.3)  # the release notification reaches the context worker
        return await free_pages(ctx, gen)

    assert_all_free(asyncio.run(main()))


def test_shutdown_unpublishes_the_peer_record(ray_session):
    ctx, gen = started(RemoteContext.remote(worker_config()), RemoteGeneration.remote(worker_config()))

    async def main():
        prompt = list(range(20))
        handle = (await ctx.prefill.remote("s", prompt, GREEDY)).kv
        agent = (await ctx.stats.remote())["agent"]
        published = lookup(agent)
        await ctx.shutdown.remote()
        with pytest.raises(PeerNotFoundError):
            lookup(agent)
        with pytest.raises(Exception, match="no KV peer"):  # a generation worker no longer finds it
            await disagg_request_from(handle, gen, prompt)
        return published, await free_pages(gen)

    published, pages = asyncio.run(main())
    assert published["compat"]["page_layout"] and published["transport"]
    assert_all_free(pages)
