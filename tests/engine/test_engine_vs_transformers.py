"""Greedy tokens of the whole engine (paged KV, window release, chunked prefill,
drafts) on windserve-tiny equal transformers' own generate on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import SamplingParams
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

# around the 32-token window and 8/16-token blocks; 200: with a budget of 100, a fresh chunk of 100
# (causal over its own keys) then 100 after a prefix (causal + the prefix read apart, engine.attention_plan)
PROMPT_LENGTHS = [7, 33, 50, 71, 200]


@pytest.fixture(scope="module")
def reference(tiny_model):
    hf = AutoModelForCausalLM.from_pretrained(tiny_model.path, local_files_only=True, attn_implementation="eager")
    hf = hf.eval()
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                              min_new_tokens=32, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    return prompts, expected


@pytest.mark.parametrize("tokens_per_block,draft_len,budget", [(8, 0, 1024), (16, 0, 24), (8, 3, 40), (8, 0, 100)])
def test_greedy_tokens_match_transformers(tiny_model, reference, tokens_per_block, draft_len, budget):
    prompts, expected = reference
    engine = make_engine(tiny_model, tokens_per_block=tokens_per_block, max_draft_len=draft_len,
                         max_num_batched_tokens=budget)
    got = run_to_completion(engine, prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    for i, want in enumerate(expected):
        assert got[f"r{i}"] == want, f"prompt of {len(prompts[i])} tokens diverges"
    if draft_len:  # the tokens match with drafts verified, some accepted, not with drafting silently off
        assert engine.num_drafts_proposed > 0 and 0 < engine.num_drafts_accepted <= engine.num_drafts_proposed
