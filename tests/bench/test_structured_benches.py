"""The structured-output benches' inputs: bench.structured_schemas writes distinct, well-formed schemas of
every kind it claims (the 200-schema target counts only if they are), and bench.structured_http sends the
two kinds different prompts of one length (no prefix-cache hit tilts its TTFT ratio)."""

from __future__ import annotations

import json

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.structured_http import RESPONSE_FORMAT, traces
from bench.structured_schemas import make_schemas


def kinds_in(schema: dict, found: set[str]) -> set[str]:
    kind = schema.get("type", "enum" if "enum" in schema else None)
    found.add(f"{kind}+pattern" if "pattern" in schema else kind)
    for child in schema.get("properties", {}).values():
        kinds_in(child, found)
    if "items" in schema:
        kinds_in(schema["items"], found)
    return found


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31))
def test_schemas_are_distinct_valid_and_cover_every_kind(seed):
    schemas = make_schemas(200, seed)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 200
    found: set[str] = set()
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["type"] == "object" and schema["required"] == sorted(schema["properties"])
        kinds_in(schema, found)
    assert found == {"object", "array", "string", "string+pattern", "boolean", "integer", "number", "enum"}
    assert make_schemas(200, seed) == schemas  # the same for the same seed


def test_the_two_kinds_get_different_prompts_of_one_length():
    batches = [traces(8, 64, batch) for batch in range(3)]
    prompts = [spec.prompt for kinds in batches for trace in kinds.values() for spec in trace]
    assert len(set(prompts)) == len(prompts)
    assert {len(p) for p in prompts} == {400}
    for kinds in batches:
        assert all(spec.extra_body is None for spec in kinds["plain"])
        assert all(spec.extra_body == RESPONSE_FORMAT for spec in kinds["json_schema"])


def test_a_spec_s_extra_body_reaches_the_request():
    from bench.serve.client import request_of

    spec = traces(1, 64, 0)["json_schema"][0]
    path, body = request_of("m", spec, chat=True)
    assert path == "chat/completions" and body["response_format"] == RESPONSE_FORMAT["response_format"]
    assert body["ignore_eos"] is False and body["messages"] == [{"role": "user", "content": spec.prompt}]
    _, plain = request_of("m", traces(1, 64, 0)["plain"][0], chat=False)
    assert "response_format" not in plain and plain["ignore_eos"] is True
