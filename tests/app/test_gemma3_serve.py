"""Gemma 3 270M served for real over HTTP (Ray, Serve, NIXL, the official ``openai`` client): disaggregated
with 3 n-gram drafts == aggregated without, token for token, and the KV bytes each request moves are the
window minimum, computed here from the design's rule, not from the library's slice planner:

    blocks of a group = ceil(P / B) - stale_end(P, W, B),  stale_end = max(0, (P + 1 - W) // B)  (0 if full)
    bytes of a group  = blocks * layers in the group * 2 (K, V) * B * kv heads * head_dim * 4 (float32)

For the 15 sliding layers (W = 512) only the last ~W / B blocks travel whatever the prompt's length, so
from a ~1,100- to a ~2,100-token prompt the bytes grow by the 3 full layers' share alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engine.loader import load_config
from engine.model_registry import GEMMA3_NAME, resolve_model_path
from engine.tokenizer import Tokenizer
from tests.app.fakes import openai_client
from tests.app.test_serve import settled_handoff_counters
from tests.serving import disagg_and_aggregated

B = 16
ENGINE = {"model": GEMMA3_NAME, "tokens_per_block": B, "num_pages": 400, "max_num_seqs": 4,
          "max_num_batched_tokens": 512, "device": "cpu", "enable_prefix_caching": False,
          "local_prefill_max_tokens": 0}
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PLACES = ["harbour", "meadow", "bridge", "church", "market", "tower", "garden"]


def notes(num: int, seed: int) -> str:
    return " ".join(f"Note {i}: the kite number {(i * seed) % 97} flew over the {PLACES[(i + seed) % 7]}."
                    for i in range(num))


PROMPTS = ["The capital of France is the city of", notes(70, 3), notes(130, 5)]  # ~8, ~1,100, ~2,100 tokens


@pytest.fixture(scope="module")
def urls() -> Iterator[dict[str, str]]:
    with disagg_and_aggregated(ENGINE, GEMMA3_NAME) as bases:
        yield bases


@pytest.fixture(scope="module")
def clients(urls) -> dict[str, openai.OpenAI]:
    return {mode: openai_client(url).with_options(timeout=300) for mode, url in urls.items()}


def window_minimum_bytes(num_prompt_tokens: int) -> int:
    config = load_config(resolve_model_path(GEMMA3_NAME))
    total = 0
    for window, num_layers in ((config.sliding_window, 15), (None, 3)):
        stale_end = 0 if window is None else max(0, (num_prompt_tokens + 1 - window) // B)
        num_blocks = -(-num_prompt_tokens // B) - stale_end
        total += num_blocks * num_layers * 2 * B * config.num_key_value_heads * config.head_dim * 4
    return total


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_disaggregated_equals_aggregated_and_moves_the_window_minimum(clients, urls, index):
    before = settled_handoff_counters(urls["disagg"])
    replies = {mode: clients[mode].completions.create(model=GEMMA3_NAME, prompt=PROMPTS[index], max_tokens=16,
                                                      **GREEDY) for mode in ("disagg", "agg")}
    assert replies["disagg"].choices[0].text == replies["agg"].choices[0].text
    assert replies["disagg"].choices[0].text.strip()
    num_prompt_tokens = replies["disagg"].usage.prompt_tokens
    num_pulls, num_bytes, *fallbacks = (a - b for a, b in zip(settled_handoff_counters(urls["disagg"]), before))
    assert (num_pulls, fallbacks) == (1, [0, 0])
    assert num_bytes == window_minimum_bytes(num_prompt_tokens), f"a prompt of {num_prompt_tokens} tokens"


def test_the_capital_of_france(clients):
    reply = clients["disagg"].completions.create(model=GEMMA3_NAME, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert "Paris" in reply.choices[0].text


def test_chat_uses_gemmas_turns_and_stops_at_end_of_turn(clients):
    reply = clients["agg"].chat.completions.create(
        model=GEMMA3_NAME, messages=[{"role": "user", "content": "Say hello."}], max_tokens=48, temperature=0)
    rendered = "<bos><start_of_turn>user\nSay hello.<end_of_turn>\n<start_of_turn>model\n"  # Gemma's format
    assert reply.usage.prompt_tokens == len(Tokenizer(resolve_model_path(GEMMA3_NAME)).encode(rendered))
    assert "<end_of_turn>" not in reply.choices[0].message.content
