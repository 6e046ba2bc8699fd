"""Issue 47 over HTTP, with the official openai client: the sampling fields reach SamplingParams,
a field that would change the answer and is not implemented is a 400 naming it, a harmless one is
ignored, and (on a live engine over windserve-tiny) a strong negative logit_bias on the greedy token
changes the output while an id outside the vocabulary is a 400; structured outputs reach the params
as one grammar, are honoured by the engine, and one that does not compile is a 400 naming its field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest

from app.api import build_api
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.grammar import GrammarSpec
from tests.app.fakes import MODEL, FakeBackend, LiveServer
from tests.engine.engine_fixtures import make_engine, run_to_completion, tiny_model  # noqa: F401

MESSAGES = [{"role": "user", "content": "Hi"}]
TINY = "windserve-tiny"


@pytest.mark.parametrize("field, value", [
    ("tool_choice", "auto"),  # without tools; tools themselves are honoured (tests/app/test_smollm2_tools.py)
    ("functions", [{"name": "f", "parameters": {}}]),
    ("function_call", "auto"),
    ("response_format", {"type": "xml"}),
    ("structured_outputs", {"json": {}, "whitespace_pattern": " "}),  # a key of vLLM's not implemented
    ("structured_outputs", {"regex": "a+", "choice": ["a"]}),  # two grammars
    ("guided_whitespace_pattern", " *"),
    ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("n", 17),
    ("best_of", 2),
    ("echo", True),
    ("min_p", 0.1),
    ("reasoning_effort", "low"),
])
def test_a_chat_field_that_would_change_the_answer_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={field: value})
    assert info.value.status_code == 400 and info.value.param == field


@pytest.mark.parametrize("field, value", [("suffix", "tail"), ("best_of", 3), ("n", 17),
                                         ("guided_whitespace_pattern", " *")])
def test_a_completion_field_that_would_change_the_answer_is_a_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", extra_body={field: value})
    assert info.value.param == field


def test_harmless_and_neutral_fields_are_ignored(client, backend):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, user="u1", metadata={"k": "v"}, store=False,
        service_tier="auto", parallel_tool_calls=False, response_format={"type": "text"}, tool_choice="none",
        extra_body={"tools": [], "prediction": {"type": "content", "content": "x"}, "best_of": 1})
    assert reply.choices[0].message.content
    assert backend.requests[reply.id][1].max_tokens == 3


def test_the_sampling_fields_reach_the_params(client, backend):
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=4, presence_penalty=0.5,
                                      frequency_penalty=-1.5, logit_bias={"65": -100, "7": 2.5},
                                      extra_body={"repetition_penalty": 1.2, "min_tokens": 2})
    params = backend.requests[reply.id][1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_tokens) == \
        (0.5, -1.5, 1.2, 2)
    assert params.logit_bias == ((7, 2.5), (65, -100.0))


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"repetition_penalty": 2.4e-246}}, "repetition_penalty"),  # logits / it overflowed to inf
    ({"extra_body": {"min_tokens": -1}}, "min_tokens"),
])
def test_out_of_range_sampling_fields_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", **kwargs)
    assert info.value.param == param


class EngineBackend:
    """app.backend's Backend over an LLMEngine in this process, one request at a time."""

    model_name = TINY

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.lock = asyncio.Lock()

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams):
        async with self.lock:
            self.engine.add_request(request_id, prompt_token_ids, params)
            while self.engine.has_unfinished():
                for update in self.engine.step():
                    yield update

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def check_health(self) -> None:
        return None

    async def stats(self) -> dict:
        return {}


@pytest.fixture(scope="module")
def tiny_client(tiny_model) -> Iterator[openai.OpenAI]:
    engine = LLMEngine(EngineConfig(device="cpu", tokens_per_block=8, max_model_len=128), model=tiny_model)
    live = LiveServer(build_api(EngineBackend(engine), tiny_model.tokenizer)).start()
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=120)
    live.stop()


def test_a_strong_negative_logit_bias_on_the_greedy_token_changes_the_output(tiny_client, tiny_model):
    prompt, params = [10, 20, 30, 40] * 4, dict(max_tokens=6, ignore_eos=True)
    direct = make_engine(tiny_model, tokens_per_block=8, max_model_len=128)
    greedy = run_to_completion(direct, [prompt], SamplingParams(**params))["r0"]
    kwargs = dict(model=TINY, prompt=prompt, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    plain = tiny_client.completions.create(**kwargs).choices[0].text
    assert plain == tiny_model.tokenizer.decode(greedy)
    biased = tiny_client.completions.create(**kwargs, logit_bias={str(greedy[0]): -100}).choices[0].text
    expected = run_to_completion(direct, [prompt], SamplingParams(**params, logit_bias={greedy[0]: -100}))["r0"]
    assert expected[0] != greedy[0] and biased == tiny_model.tokenizer.decode(expected) != plain


def test_a_logit_bias_outside_the_vocabulary_is_a_400_naming_the_id(tiny_client, tiny_model):
    vocab_size = tiny_model.tokenizer.vocab_size
    with pytest.raises(openai.BadRequestError) as info:
        tiny_client.completions.create(model=TINY, prompt=[1, 2, 3], max_tokens=2,
                                       logit_bias={str(vocab_size + 5): -100})
    assert info.value.param == "logit_bias" and str(vocab_size + 5) in info.value.message


def test_a_model_name_with_a_lone_surrogate_is_a_400_not_a_500(http):
    """The name is echoed in the 404's message; a lone surrogate there could not be encoded (a fuzzed case)."""
    raw = b'{"messages": [{"role": "user", "content": "hi"}], "model": "\xed\xa0\x80tiny", "max_tokens": 2}'
    reply = http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "model"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}


@pytest.mark.parametrize("extra, grammar", [
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"regex": "a+"}}, GrammarSpec("regex", "a+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec.choice(["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarSpec("ebnf", 'root ::= "a"')),
    ({"guided_json": SCHEMA}, GrammarSpec.json_schema(SCHEMA)),
    ({"guided_choice": ["a", "b"]}, GrammarSpec.choice(["a", "b"])),
    ({"response_format": {"type": "text"}, "guided_regex": "a+"}, GrammarSpec("regex", "a+")),
], ids=["json_object", "json_schema", "so-json", "so-regex", "so-choice", "so-grammar", "guided_json",
        "guided_choice", "text+guided_regex"])
def test_structured_outputs_reach_the_params_as_one_grammar(client, backend, extra, grammar):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, extra_body=extra)
    assert backend.requests[reply.id][1].grammar == grammar


def test_structured_outputs_on_a_live_engine(tiny_client, tiny_model):
    """windserve-tiny (random weights) writes what the grammar allows, and ends itself: a bounded schema."""
    reply = tiny_client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=40, temperature=0,
                                                response_format={"type": "json_schema",
                                                                 "json_schema": {"name": "n", "schema": SCHEMA}})
    assert reply.choices[0].finish_reason == "stop" and 1 <= json.loads(reply.choices[0].message.content)["n"] <= 9
    reply = tiny_client.completions.create(model=TINY, prompt="x", max_tokens=8, temperature=1.0, seed=3,
                                           extra_body={"structured_outputs": {"choice": ["left", "right"]}})
    assert reply.choices[0].text in ("left", "right") and reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
])
def test_a_grammar_that_does_not_compile_is_a_400_naming_its_field(tiny_client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        tiny_client.completions.create(model=TINY, prompt="x", max_tokens=2, extra_body=extra)
    assert info.value.param == param and "compile" in info.value.message
