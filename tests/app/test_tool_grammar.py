"""app.tools' grammar, compiled by engine.grammar_compile over windserve-tiny's byte vocabulary: random
walks through it (a seeded pick among the allowed tokens each step) write only calls that
app.tool_parser reads back, of the chosen tools, with arguments valid against their schemas, one call
with parallel_tool_calls false; what it must refuse (another name, text before a call) it refuses."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from app.tool_parser import format_call, parse_tool_calls
from app.tools import NamedToolChoice, Tool, tool_call_grammar
from engine.grammar import new_bitmask
from engine.grammar_compile import GrammarCompiler
from tests.engine.engine_fixtures import tiny_model  # noqa: F401

TOOLS = [Tool.model_validate(t) for t in (
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 3},
                                         "unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "maximum": 9}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {}}},
    {"type": "function", "function": {"name": "flags", "parameters": {
        "properties": {"on": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                           "maxItems": 2}}, "required": ["on"]}}})]
SCHEMAS = {tool.function.name: tool.function.arguments_schema() for tool in TOOLS}
MAX_STEPS = 400


@pytest.fixture(scope="module")
def compiler(tiny_model):
    return GrammarCompiler(tiny_model.tokenizer.hf_tokenizer, tiny_model.hf_config.vocab_size)


def walk(compiler, spec, stop_ids, seed, vocab_size, prefer_stop_after):
    """Token ids of a random path through the grammar, ending on a stop id (taken once allowed and
    ``prefer_stop_after`` tokens are out, or when nothing else is allowed)."""
    matcher, picks, out = compiler.matcher(spec, stop_ids), random.Random(seed), []
    while not out or out[-1] not in stop_ids:
        assert len(out) < MAX_STEPS
        bitmask = new_bitmask(1, vocab_size)
        matcher.sync(out)
        matcher.fill(bitmask, 0)
        allowed = [t for t in range(vocab_size) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        stops, others = [t for t in allowed if t in stop_ids], [t for t in allowed if t not in stop_ids]
        out.append(picks.choice(stops if stops and (len(out) >= prefer_stop_after or not others) else others))
    return out[:-1]


@pytest.mark.parametrize("choice, parallel", [("required", False), ("required", True),
                                              ({"type": "function", "function": {"name": "flags"}}, True)],
                         ids=["required-one", "required", "named"])
@pytest.mark.parametrize("seed", range(4))
def test_every_walk_writes_calls_that_parse_and_validate(tiny_model, compiler, choice, parallel, seed):
    choice = choice if isinstance(choice, str) else NamedToolChoice.model_validate(choice)
    spec = tool_call_grammar(TOOLS, choice, parallel)
    stop_ids = list(tiny_model.tokenizer.eos_token_ids)
    ids = walk(compiler, spec, stop_ids, seed, tiny_model.hf_config.vocab_size, prefer_stop_after=150)
    content, calls = parse_tool_calls(tiny_model.tokenizer.decode(ids), SCHEMAS)
    assert content is None and calls and (parallel or len(calls) == 1)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert choice == "required" or call.name == "flags"


def test_the_grammar_refuses_what_is_not_a_call_of_the_chosen_tools(tiny_model, compiler):
    stop_ids = list(tiny_model.tokenizer.eos_token_ids)
    named = tool_call_grammar(TOOLS, NamedToolChoice.model_validate({"type": "function",
                                                                     "function": {"name": "ping"}}), False)
    encode = tiny_model.tokenizer.encode

    def accepts(spec, text):
        matcher = compiler.matcher(spec, stop_ids)
        try:
            matcher.sync(encode(text) + stop_ids[:1])
        except ValueError:
            return False
        return True

    assert accepts(named, format_call("ping", {}))
    assert not accepts(named, format_call("get_weather", {"city": "Oslo", "unit": "c"}))
    assert not accepts(named, "Sure. " + format_call("ping", {}))
    assert not accepts(named, format_call("ping", {}) + "\n" + format_call("ping", {}))  # one call only
    required = tool_call_grammar(TOOLS, "required", True)
    assert accepts(required, format_call("ping", {}) + "\n" + format_call("flags", {"on": True}))
    assert not accepts(required, format_call("get_weather", {"city": "Oslo", "unit": "c"}))  # maxLength 3
    assert not accepts(required, "")
