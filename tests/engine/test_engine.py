"""The engine end to end on windserve-tiny: batching, chunking, drafts, exhaustion, stops."""

import random

import pytest

from engine import PromptTooLongError, SamplingParams
from engine.draft_policy import DraftLengthPolicy
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture
def clockless_drafts(monkeypatch):
    """The draft policy fed step times from a fixed cost line (2 ms + 0.5 ms a query token) instead of the
    clock: how much it drafts then depends on acceptance alone, not on how loaded the machine is (a
    loaded run once drafted 3 times and had none accepted)."""
    record = DraftLengthPolicy.record_step

    def fixed(self, scheduled, seconds):
        record(self, scheduled, 0.002 + 0.0005 * sum(item.num_query_tokens for item in scheduled))

    monkeypatch.setattr(DraftLengthPolicy, "record_step", fixed)


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Lengths around the window (32) and the block size, some with repetition."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.choice([1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 90])
        base = [rng.randrange(256) for _ in range(max(1, length // 3))]
        prompt = (base * 4)[:length] if i % 2 else [rng.randrange(256) for _ in range(length)]
        prompts.append(prompt)
    return prompts


def test_batched_equals_alone_with_chunked_prefill(tiny_model):
    prompts = mixed_prompts(16)
    batched = run_to_completion(make_engine(tiny_model, tokens_per_block=8, max_num_batched_tokens=48), prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        alone = run_to_completion(make_engine(tiny_model, tokens_per_block=8), [prompt], GREEDY)
        assert batched[f"r{i}"] == alone["r0"], f"request {i} (prompt length {len(prompt)}) differs"


@pytest.mark.parametrize("draft_len", [1, 2, 3, 4])
def test_speculative_greedy_output_is_identical(tiny_model, draft_len, clockless_drafts):
    """With the adaptive policy as served; half the prompts repeat a unit, so drafts are proposed and
    some accepted: identical output is then speculation's doing, not speculation switched off."""
    prompts = mixed_prompts(6, seed=1)
    base = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, GREEDY)
    engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len)
    assert run_to_completion(engine, prompts, GREEDY) == base
    assert engine.num_drafts_proposed > 0 and 0 < engine.num_drafts_accepted <= engine.num_drafts_proposed


@pytest.mark.parametrize("draft_len", [1, 2, 3])
def test_speculative_seeded_output_is_identical(tiny_model, draft_len):
    """Seeded sampling with drafts gives the tokens it gives without: each output position's draw
    is seeded by (seed, position), and a draft is accepted only where it equals that draw."""
    prompts = mixed_prompts(5, seed=3) + [[10, 20, 30, 40, 50] * 8]
    params = [SamplingParams(max_tokens=24, temperature=t, seed=100 + i, ignore_eos=True)
              for i, t in enumerate([0.2, 0.5, 1.0, 0.2, 0.5, 0.2])]
    base = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, params)
    engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len)
    # always the longest draft (the adaptive policy drafts nothing where acceptance is low)
    engine.scheduler.draft_policy.draft_len = lambda num_accepted, num_proposed, num_steps: draft_len
    assert run_to_completion(engine, prompts, params) == base
    assert engine.num_drafts_accepted > 0  # speculation really ran, and some drafts passed


def test_drafts_are_accepted_on_repetitive_prompts(tiny_model, clockless_drafts):
    engine = make_engine(tiny_model, tokens_per_block=8, max_draft_len=3)
    prompt = [10, 20, 30, 40, 50] * 8
    engine.add_request("rep", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    proposed = accepted = 0
    while engine.has_unfinished():
        for update in engine.step():
            proposed, accepted = update.num_drafts_proposed, update.num_drafts_accepted
    assert proposed > 0 and accepted > 0
    assert engine.runner.num_forward_passes < 40


def test_kv_exhaustion_queues_and_preempts_without_losing_requests(tiny_model):
    prompts = mixed_prompts(12, seed=2)
    roomy = run_to_completion(make_engine(tiny_model, tokens_per_block=8), prompts, GREEDY)
    tight = make_engine(tiny_model, tokens_per_block=8, num_pages=20, max_num_batched_tokens=64)
    assert run_to_completion(tight, prompts, GREEDY) == roomy
    assert tight.scheduler.num_preemptions > 0


def test_seeded_sampling_is_reproducible_alone_and_batched(tiny_model):
    sampled = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    prompt = [65, 66, 67, 68]
    alone = run_to_completion(make_engine(tiny_model), [prompt], sampled)["r0"]
    others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    batched = run_to_completion(make_engine(tiny_model), [[1, 2, 3], prompt, [9] * 40], [others[0], sampled, others[1]])
    assert batched["r1"] == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True)
    unseeded = run_to_completion(make_engine(tiny_model), [prompt], other_seed)
    assert unseeded["r0"] != alone


def test_max_tokens_stop_token_and_stop_string(tiny_model):
    engine = make_engine(tiny_model)
    free = run_to_completion(engine, [[72, 105]], SamplingParams(max_tokens=12, ignore_eos=True))["r0"]
    assert len(free) == 12
    stop_id = free[5]
    first = free.index(stop_id)
    at_stop = SamplingParams(max_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True)
    stopped = run_to_completion(make_engine(tiny_model), [[72, 105]], at_stop)["r0"]
    assert stopped == free[: first + 1]


def test_stop_string_cuts_text(tiny_model):
    engine = make_engine(tiny_model)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("a", [72, 105, 33], params)
    text = ""
    while engine.has_unfinished():
        text += "".join(u.new_text for u in engine.step())
    stop = text[10:12]
    assert stop and len(text) > 12
    engine.add_request("b", [72, 105, 33], SamplingParams(max_tokens=30, ignore_eos=True, stop=(stop,)))
    pieces, reason = [], None
    while engine.has_unfinished():
        for u in engine.step():
            pieces.append(u.new_text)
            reason = u.finish_reason or reason
    assert "".join(pieces) == text[: text.index(stop)]
    assert reason == "stop"


def test_prompt_too_long_is_a_clear_error(tiny_model):
    engine = make_engine(tiny_model, tokens_per_block=8, num_pages=8)
    with pytest.raises(PromptTooLongError, match="maximum context length is 64"):
        engine.add_request("long", [1] * 64, GREEDY)
    with pytest.raises(PromptTooLongError, match="empty"):
        engine.add_request("empty", [], GREEDY)


def test_abort_frees_pages_at_every_stage(tiny_model):
    engine = make_engine(tiny_model, tokens_per_block=8, max_num_batched_tokens=16)
    engine.add_request("a", list(range(60)), GREEDY)   # chunked: still prefilling after one step
    engine.add_request("b", [5, 6, 7], GREEDY)
    engine.add_request("c", [8] * 10, GREEDY)          # still waiting
    engine.step()
    assert engine.abort("a") and engine.abort("c")
    for _ in range(3):
        engine.step()
    assert engine.abort("b")
    assert not engine.abort("b")
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_the_pools_helpers_yield_in_decode_only_steps(tiny_model, monkeypatch):  # noqa: F811
    """engine/native/work_pool.cpp's helpers yield their core between kernels in steps that only decode,
    and pause in steps that prefill (whose GEMMs run on OpenMP's threads): the runner says which, per step,
    from what the step computes. A prompt longer than the step's token budget prefills over two steps."""
    engine = make_engine(tiny_model, max_num_batched_tokens=40, enable_prefix_caching=False)
    calls: list[bool] = []
    monkeypatch.setattr(engine.runner, "_set_pool_yields", calls.append)
    engine.add_request("a", list(range(5, 35)), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = [engine.step()]  # a's prefill (30 tokens)
    engine.add_request("b", list(range(100, 150)), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        steps.append(engine.step())
    computed = [[u.request_id for u in updates if u.new_token_ids] for updates in steps]
    # a prefills; a decodes with b's first 39 tokens; a with b's last 11 (b's first token); both decode
    assert computed[:3] == [["a"], ["a"], ["a", "b"]]
    assert calls[:4] == [False, False, False, True]
    assert all(calls[3:]) and len(calls) == len(steps)
