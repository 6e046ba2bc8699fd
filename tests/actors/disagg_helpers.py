"""Start real context/generation workers as Ray actors and drive requests through them."""

from __future__ import annotations

import asyncio
import random

import ray

from actors.aggregated_worker import AggregatedWorker
from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.generation_worker import GenerationWorker
from actors.messages import Prefilled
from engine import SamplingParams
from engine.outputs import RequestUpdate, without_first_token
from kvcache import KVCacheManager, slice_range
from tests.engine.engine_fixtures import make_engine
from tests.engine.test_handoff import CANDIDATES, crosses_a_block, handoff_len

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


def prompts_sharing_prefixes(n: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two waves of ``n`` prompts together. The first: ``random_prompts``, every third behind a
    48-token system prompt. The second: one per first-wave prompt, in order, its repeat, a fork
    (its first k tokens, then new ones), or a follow-up (it, then more turns)."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(48)]
    first = [system + p if i % 3 == 1 else p for i, p in enumerate(random_prompts(n - n // 2, seed))]
    second = []
    for i, prompt in enumerate(first[: n // 2]):
        kind = i % 3
        tail = [rng.randrange(256) for _ in range(rng.randint(1, 24))]
        if kind == 0:
            second.append(list(prompt))
        elif kind == 1:
            second.append(prompt[: rng.randint(1, len(prompt))] + tail)
        else:
            second.append(prompt + tail)
    return first, second


async def disagg_request(ctx, gen, request_id: str, prompt: list[int], params: SamplingParams,
                         handle=None) -> list[int]:
    """Prefill on ``ctx`` (unless a handle is given), decode on ``gen``; the generated tokens."""
    return (await disagg_usage(ctx, gen, request_id, prompt, params, handle))[0]


async def disagg_usage(ctx, gen, request_id: str, prompt: list[int], params: SamplingParams,
                       handle=None) -> tuple[list[int], int]:
    """``disagg_request``, and the prompt tokens the last update reports as cached."""
    if handle is None:
        prefilled = await ctx.prefill.remote(request_id, prompt, params)
        if prefilled.kv is None:  # the first token ended it: no generation worker
            return prefilled.first.new_token_ids, prefilled.first.num_cached_tokens
        handle = prefilled.kv
    tokens, num_cached_tokens = [], 0
    async for ref in gen.generate.remote(handle, prompt, params):
        update = await ref
        tokens += update.new_token_ids
        num_cached_tokens = update.num_cached_tokens
        if update.finish_reason == "error":
            raise RuntimeError(update.error)
    return tokens, num_cached_tokens


def slice_bytes(manager: KVCacheManager, num_kv_tokens: int) -> int:
    """Bytes of the windowed slice of ``num_kv_tokens`` (kvcache's planner), over ``manager``'s groups:
    what a pull moves when the receiver holds none of it."""
    B = manager.spec.tokens_per_block
    return sum(len(slice_range(num_kv_tokens, g.window, B)) * manager.storage.page_nbytes(g.name)
               for g in manager.spec.groups)


async def transfer_counts(*generations) -> list[tuple[int, int]]:
    """(transfer fallbacks, transfers) per generation worker: a test that made ``n`` handoffs to one
    expects (0, n); a fallback prefills locally and gives the same tokens, so only this tells them apart."""
    stats = [await gen.stats.remote() for gen in generations]
    return [(s["num_transfer_fallbacks"], s["kv_transfers"]) for s in stats]


def run_in_order(engine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], int]]:
    """Aggregated reference: each prompt alone, one after the other; its tokens and cached tokens."""
    out = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        tokens, num_cached_tokens = [], 0
        while engine.has_unfinished():
            for update in engine.step():
                tokens += update.new_token_ids
                num_cached_tokens = update.num_cached_tokens
        out.append((tokens, num_cached_tokens))
    return out


async def free_pages(*workers) -> list[tuple[int, int]]:
    """(free, total) pages per worker, after its integrity check: every page free or evictable at rest."""
    out = []
    for worker in workers:
        await worker.check_integrity.remote()
        stats = await worker.stats.remote()
        out.append((stats["num_free_pages"], stats["num_total_pages"]))
    return out


def held_back_prompts(tiny_model, params, n: int = 4):
    """Prompts whose token 0 is held back (half a character), with their aggregated tokens and
    logprobs, each run alone: found by search, those whose handoff fills a new block first."""
    aggregated = make_engine(tiny_model, tokens_per_block=8)
    found = []
    for r, prompt in enumerate(CANDIDATES):
        aggregated.add_request(f"r{r}", prompt, params)
        tokens, logprobs = [], []
        while aggregated.has_unfinished():
            for update in aggregated.step():
                tokens += update.new_token_ids
                logprobs += update.logprobs or []
        k, _ = handoff_len(tiny_model.tokenizer, prompt, tokens)
        if k > 1:
            found.append((not crosses_a_block(prompt, k), prompt, k, tokens, logprobs))
    assert len(found) >= 2, "no prompt with a held-back token 0 among the candidates"
    return [case[1:] for case in sorted(found, key=lambda case: case[0])[:n]]


async def client_stream(gen, prefilled: Prefilled, prompt: list[int], params: SamplingParams) -> list[RequestUpdate]:
    """What the ingress streams: the handed-over update, then the generation stream less its repeat of it."""
    stream, first = [prefilled.first], prefilled.first
    async for ref in gen.generate.remote(prefilled.kv, prompt, params):
        update = await ref
        stream.append(without_first_token(first, update) if first is not None else update)
        first = None
    return stream
