"""Prefix caching in the engine: outputs are identical with the cache on and off, and hits are real.

Workloads share prefixes the way chat traffic does: one system prompt under
many questions, and multi-turn chats whose next prompt is the previous
prompt + answer + a new question. Each runs on GPT-OSS (window + full
groups, sinks), Mistral (every layer windowed) and Llama (full attention),
with drafts 0 and 3, batched, sequential and under preemption.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.worker_model import WorkerModel
from tests.engine.engine_fixtures import tiny_model  # noqa: F401
from tests.engine.helpers import load_pair

B = 8
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
ARCHS = ["windserve-tiny", "mistral", "llama"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tiny_model) -> WorkerModel:  # noqa: F811
    if request.param == "windserve-tiny":
        return tiny_model
    _, module, config = load_pair(request.param)
    return WorkerModel(request.param, "", module.eval(), tiny_model.tokenizer, config, "cpu", torch.float32)


def engine_for(model: WorkerModel, caching: bool, **kwargs) -> LLMEngine:
    config = EngineConfig(model=model.name, device="cpu", tokens_per_block=B, enable_prefix_caching=caching, **kwargs)
    return LLMEngine(config, model=model)


def vocab(model: WorkerModel) -> int:
    return min(int(model.hf_config.vocab_size), 256)


def shared_prompts(model: WorkerModel, seed: int, n: int = 6) -> list[list[int]]:
    """One system prompt (45 tokens: not a whole number of blocks) under ``n`` questions."""
    rng = random.Random(seed)
    system = [rng.randrange(vocab(model)) for _ in range(45)]
    return [system + [rng.randrange(vocab(model)) for _ in range(rng.randrange(1, 20))] for _ in range(n)]


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY, *, one_by_one: bool = False):
    """Token ids and reported cached tokens per request; every page free (or evictable) at the end."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    for batch in batches:
        for prompt in batch:
            rid = f"r{len(tokens)}"
            tokens[rid] = []
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished():
            for update in engine.step():
                tokens[update.request_id] += update.new_token_ids
                cached[update.request_id] = update.num_cached_tokens
                engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
    return tokens, cached


@pytest.mark.parametrize("draft_len", [0, 3])
def test_shared_system_prompt_same_tokens_with_and_without_cache(model, draft_len):
    prompts = shared_prompts(model, seed=draft_len)
    off, off_cached = run(engine_for(model, False, max_draft_len=draft_len), prompts, one_by_one=True)
    engine = engine_for(model, True, max_draft_len=draft_len)
    on, on_cached = run(engine, prompts, one_by_one=True)
    assert on == off
    assert set(off_cached.values()) == {0}
    # Request 0 computes the system prompt; every later one reuses its 5 full blocks (40 tokens).
    assert on_cached["r0"] == 0
    assert all(on_cached[f"r{i}"] == 40 for i in range(1, len(prompts)))
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 40 * (len(prompts) - 1)
    assert stats["prefix_cache_queries"] == sum(len(p) for p in prompts)


def test_batched_shared_prefix_same_tokens(model):
    prompts = shared_prompts(model, seed=7, n=8)
    off, _ = run(engine_for(model, False, max_num_batched_tokens=40), prompts)
    on, _ = run(engine_for(model, True, max_num_batched_tokens=40), prompts)
    assert on == off


@pytest.mark.parametrize("draft_len", [0, 3])
def test_multi_turn_reuses_the_whole_conversation(model, draft_len):
    """Turn k+1's prompt = turn k's prompt + answer + a question: the answer's blocks hit too."""
    rng = random.Random(11)
    engines = {c: engine_for(model, c, max_draft_len=draft_len) for c in (False, True)}
    first = [rng.randrange(vocab(model)) for _ in range(21)]
    history = {c: list(first) for c in (False, True)}
    question_rng = random.Random(12)
    for turn in range(4):
        question = [question_rng.randrange(vocab(model)) for _ in range(5)]
        answers = {}
        for caching, engine in engines.items():
            prompt = history[caching] + question
            tokens, cached = run(engine, [prompt])
            answers[caching] = tokens["r0"]
            if caching and turn > 0:
                # Everything before this turn's question was computed by the previous turn.
                assert cached["r0"] == (len(history[caching]) - 1) // B * B
            history[caching] = prompt + tokens["r0"]
        assert answers[True] == answers[False], f"turn {turn} differs"


def test_seeded_sampling_same_with_and_without_cache(model):
    prompts = shared_prompts(model, seed=3)
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)
    off, _ = run(engine_for(model, False), prompts, params, one_by_one=True)
    on, _ = run(engine_for(model, True), prompts, params, one_by_one=True)
    assert on == off


@pytest.mark.parametrize("draft_len", [0, 3])
def test_preemption_with_cache_on_same_tokens(model, draft_len):
    """A tight pool preempts; a preempted request comes back to its own cached prefix."""
    prompts = shared_prompts(model, seed=4, n=8)
    roomy, _ = run(engine_for(model, False, max_draft_len=draft_len), prompts)
    tight = engine_for(model, True, max_draft_len=draft_len, num_pages=12, max_num_batched_tokens=48)
    tokens, _ = run(tight, prompts)
    assert tokens == roomy
    if model.name != "mistral":  # all-window layers hold ~3 pages a request: growth never preempts here
        assert tight.scheduler.num_preemptions > 0


@pytest.mark.parametrize("draft_len", [0, 3])
def test_preempted_request_resumes_from_its_own_cached_blocks(model, draft_len):
    """Preempt mid-decode by hand: re-admission hits the request's own named blocks, output unchanged."""
    prompt = shared_prompts(model, seed=9, n=1)[0]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected, _ = run(engine_for(model, False, max_draft_len=draft_len), [prompt], params)
    engine = engine_for(model, True, max_draft_len=draft_len)
    engine.add_request("r0", prompt, params)
    tokens = []
    while len(tokens) < 8:
        tokens += [t for u in engine.step() for t in u.new_token_ids]
    request = engine.scheduler.running[0]
    num_tokens_at_preemption = request.num_tokens
    engine.scheduler.preempt(request)
    hits_before = engine.scheduler.num_prefix_hit_tokens
    while engine.has_unfinished():
        tokens += [t for u in engine.step() for t in u.new_token_ids]
        engine.manager.check_integrity()
    assert tokens == expected["r0"]
    # Every whole block computed before the preemption is reused; the pending token is recomputed.
    resumed_hit = engine.scheduler.num_prefix_hit_tokens - hits_before
    assert resumed_hit == (num_tokens_at_preemption - 1) // B * B
