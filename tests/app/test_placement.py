"""The ingress's view of the workers' caches: its hints name blocks as the engine does, and the
engine's routing stats (queued prefill, cache summaries) tell a router the hit the engine itself gets."""

from __future__ import annotations

import random

import pytest

from app.config import AppConfig
from app.placement import GenerationCaches, PromptHasher
from app.routing import ReplicaView, RoutingHint
from engine import LLMEngine, SamplingParams
from engine.model_registry import resolve_model_path
from engine.reports import summarize_cache

B = 8
ARGS = {"tokens_per_block": B, "num_pages": 64, "device": "cpu", "max_num_batched_tokens": 64}
GREEDY = SamplingParams(max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def config() -> AppConfig:
    return AppConfig.model_validate(ARGS)


@pytest.fixture(scope="module")
def hasher(config) -> PromptHasher:
    return PromptHasher(config, resolve_model_path(config.model))


@pytest.fixture
def engine(config) -> LLMEngine:
    return LLMEngine(config.to_worker_config(), role="generation")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200) for _ in range(n)]


def run(engine: LLMEngine, request_id: str, token_ids: list[int]) -> None:
    engine.add_request(request_id, token_ids, GREEDY)
    while engine.has_unfinished():
        engine.step()


def view(engine: LLMEngine) -> ReplicaView:
    return ReplicaView.from_stats({**engine.stats(), **summarize_cache(engine.routing_stats())})


def test_the_ingress_names_blocks_as_the_engine_does(engine, hasher):
    assert hasher.fingerprint == engine.hash_extra
    system = prompt(0, 45)  # 5 full blocks and 5 tokens
    run(engine, "warm", system + prompt(1, 10))
    follow_up = system + prompt(2, 30)
    hint = hasher.hint("next", follow_up)
    assert hint.num_prompt_tokens == 75 and len(hint.block_hashes) == 75 // B
    assert view(engine).hit(hint) == 40  # blocks 0..4 hold the system prompt; block 5 differs
    engine.add_request("next", follow_up, GREEDY)
    engine.step()
    assert engine.stats()["prefix_cache_hits"] == 40  # the engine's own hit agrees


def test_queued_prefill_counts_waiting_and_uncomputed_prompt_tokens(engine):
    assert engine.routing_stats()["queued_prefill_tokens"] == 0
    engine.add_request("a", prompt(3, 100), GREEDY)
    engine.add_request("b", prompt(4, 30), GREEDY)
    assert engine.routing_stats()["queued_prefill_tokens"] == 130
    engine.step()  # 64 tokens of a's prompt computed (max_num_batched_tokens)
    assert engine.routing_stats()["queued_prefill_tokens"] == 36 + 30
    while engine.has_unfinished():
        engine.step()
    assert engine.routing_stats()["queued_prefill_tokens"] == 0


def test_routing_stats_describe_the_groups(engine):
    stats = summarize_cache(engine.routing_stats())
    assert stats["tokens_per_block"] == B and stats["kv_fingerprint"] == engine.hash_extra
    assert stats["windows"] == {g.name: g.window for g in engine.manager.spec.groups}
    assert set(stats["cache_summaries"]) == set(stats["windows"])
    assert all(len(raw) < 100 for raw in stats["cache_summaries"].values())  # 64 pages: a few dozen bytes


def test_generation_caches_take_the_best_generation_replica(engine, hasher):
    system = prompt(5, 40)
    run(engine, "warm", system + prompt(6, 3))
    hint = hasher.hint("q", system + prompt(7, 20))
    warm = {"role": "generation", **engine.stats(), **summarize_cache(engine.routing_stats())}
    caches = GenerationCaches(board=None)
    assert caches.best_hit(hint) == 0  # nothing reported yet
    context = {**warm, "role": "context"}
    caches.update([context, {"role": "generation"}])  # a context replica and one that never reported
    assert caches.best_hit(hint) == 0
    caches.update([warm, context])
    assert caches.best_hit(hint) == 40
    assert caches.best_hit(RoutingHint("other", 60)) == 0  # no block names: no hit
