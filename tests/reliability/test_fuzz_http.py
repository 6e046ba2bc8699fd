"""Fuzzing the live deployment's HTTP API from its OpenAPI schema, and its security surface.

The app serves no /openapi.json (build_api turns it off; a 404 here), so the
schema is the one FastAPI derives from the same routes and pydantic models
(``build_api(...).openapi()``). Bodies are drawn from it with hypothesis,
then mutated: wrong types, unknown fields, huge prompts and max_tokens,
invalid UTF-8, truncated JSON, empty messages, pickles. Every answer must be
a 2xx or a 4xx in OpenAI's error shape: never a 500, never a failed stream.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import build_api
from tests.app.fakes import ByteTokenizer, FakeBackend
from tests.reliability.conftest import (
    AUTH,
    MAX_MODEL_LEN,
    MODEL,
    Service,
    completion_body,
    wait_pages_free,
    wait_serving,
)

MAX_EXAMPLES = int(os.environ.get("WINDSERVE_FUZZ_EXAMPLES", "150"))
SCHEMA = build_api(FakeBackend(), ByteTokenizer()).openapi()
GENERATION_ROUTES = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
ERROR_KEYS = {"message", "type", "param", "code"}
SMALL_MAX_TOKENS = ("max_tokens", "max_completion_tokens")
REPO = Path(__file__).resolve().parents[2]


def resolve(node: dict) -> dict:
    while "$ref" in node:
        node = SCHEMA["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
    return node


def from_schema(node: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid-ish for one JSON schema node (bounds loosely kept, sizes small)."""
    node = resolve(node)
    if "anyOf" in node:
        return st.one_of([from_schema(option, depth + 1) for option in node["anyOf"]])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node.get("type")
    if kind == "string":
        return st.text(max_size=24)
    if kind == "integer":
        return st.integers(int(node.get("minimum", -5)), int(min(node.get("maximum", 40), 40)))
    if kind == "number":
        return st.floats(node.get("minimum", -1.0), node.get("maximum", 3.0), allow_nan=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        if depth > 3:
            return st.just([])
        return st.lists(from_schema(node.get("items", {}), depth + 1), min_size=node.get("minItems", 0), max_size=3)
    if kind == "object" and "properties" in node and depth <= 3:
        return object_from_schema(node, depth)
    return st.one_of(st.none(), st.integers(), st.text(max_size=8))


def object_from_schema(node: dict, depth: int = 0) -> st.SearchStrategy:
    required = set(node.get("required", ()))
    fields = {name: from_schema(sub, depth + 1) for name, sub in node["properties"].items()}
    optional = sorted(set(fields) - required)
    return st.fixed_dictionaries({k: fields[k] for k in sorted(required)},
                                 optional={k: fields[k] for k in optional})


def keep_fast(body: dict) -> dict:
    """Small generations, whatever was drawn: the fuzzer tests the edges, not the decoder."""
    fast = {**body, "model": MODEL}
    for key in SMALL_MAX_TOKENS:
        if key in fast and (not isinstance(fast[key], int) or isinstance(fast[key], bool) or fast[key] > 4):
            fast[key] = 2
    if "max_tokens" not in fast and "max_completion_tokens" not in fast:
        fast["max_tokens"] = 2
    return fast


WRONG_TYPES = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=8),
                        st.lists(st.integers(), max_size=3),
                        st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def mutate(route: str, body: dict, draw) -> bytes:
    """One mutation of a valid-ish body, as the raw bytes sent."""
    prompt_key = "prompt" if route == "/v1/completions" else "messages"
    mutation = draw(st.sampled_from(["none", "wrong_type", "unknown_field", "huge_prompt", "huge_max_tokens",
                                     "negative_max_tokens", "empty_prompt", "bad_utf8", "bad_json", "pickle",
                                     "token_ids", "not_an_object"]))
    if mutation == "wrong_type":
        body[draw(st.sampled_from(sorted(body)))] = draw(WRONG_TYPES)
    elif mutation == "unknown_field":
        body[draw(st.text(min_size=1, max_size=12))] = draw(WRONG_TYPES)
    elif mutation == "huge_prompt":
        text = "x" * draw(st.sampled_from([MAX_MODEL_LEN, 10 * MAX_MODEL_LEN, 1_000_000]))
        body[prompt_key] = text if prompt_key == "prompt" else [{"role": "user", "content": text}]
    elif mutation == "huge_max_tokens":
        # the room left is clamped to a few tokens: a long prompt keeps the generation short
        text = "y" * (MAX_MODEL_LEN - 40)
        body[prompt_key] = text if prompt_key == "prompt" else [{"role": "user", "content": text}]
        body["max_tokens"] = draw(st.sampled_from([10**6, 2**31, 2**63, 2**64 + 1, 10**40]))
    elif mutation == "negative_max_tokens":
        body["max_tokens"] = draw(st.integers(-2**64, 0))
    elif mutation == "empty_prompt":
        body[prompt_key] = draw(st.sampled_from(["", [], [[]], [""], [{}]] if prompt_key == "prompt" else [[], [{}]]))
    elif mutation == "token_ids" and prompt_key == "prompt":
        body["prompt"] = draw(st.lists(st.integers(-5, 2**40), min_size=1, max_size=8))
    elif mutation == "pickle":
        payload = pickle.dumps({"x": 1}).decode("latin-1")
        body[prompt_key] = payload if prompt_key == "prompt" else [{"role": "user", "content": payload}]
    elif mutation == "not_an_object":
        return json.dumps(draw(WRONG_TYPES)).encode()
    raw = json.dumps(body).encode()
    if mutation == "bad_utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + raw[at:]
    elif mutation == "bad_json":
        raw = raw[:draw(st.integers(0, max(0, len(raw) - 1)))]
    return raw


@st.composite
def requests(draw) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(GENERATION_ROUTES)))
    body = keep_fast(draw(object_from_schema(resolve({"$ref": GENERATION_ROUTES[route]}))))
    return route, mutate(route, body, draw)


def check_answer(reply: httpx.Response) -> None:
    assert reply.status_code < 500, (reply.status_code, reply.text[:300])
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert set(error) == ERROR_KEYS and error["type"] == "invalid_request_error", error
        assert isinstance(error["message"], str) and error["message"]
        return
    if reply.headers["content-type"].startswith("text/event-stream"):
        assert reply.text.endswith("data: [DONE]\n\n")
        assert '"server_error"' not in reply.text, reply.text[-300:]
    else:
        assert reply.json()["object"] in ("text_completion", "chat.completion")


@pytest.fixture(scope="module")
def http(service: Service):
    assert wait_serving(service)
    with service.client(timeout_s=30) as client:
        yield client


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests())
def test_fuzzed_bodies_get_no_500(http: httpx.Client, request: tuple[str, bytes]):
    route, raw = request
    check_answer(http.post(route, content=raw, headers={"Content-Type": "application/json"}))


def test_fuzzing_leaked_no_pages(service: Service):
    assert wait_pages_free(service, timeout_s=15) is not None


def test_openapi_json_is_not_served(service: Service):
    reply = httpx.get(f"{service.url}/openapi.json", timeout=10)
    assert reply.status_code == 404 and set(reply.json()["error"]) == ERROR_KEYS


def schema_routes() -> list[tuple[str, str]]:
    return [(method.upper(), path.replace("{model}", MODEL)) for path, methods in SCHEMA["paths"].items()
            for method in methods if path.startswith("/v1")]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "reliability-key"}],
                         ids=["no-key", "wrong-key", "no-bearer"])
def test_every_v1_route_needs_the_api_key(service: Service, headers: dict):
    routes = schema_routes() + [("GET", "/v1"), ("POST", "/v1/embeddings"), ("GET", "/v1/../v1/models")]
    assert {path for _, path in routes} >= set(GENERATION_ROUTES) | {"/v1/models", f"/v1/models/{MODEL}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=10) as http:
        for method, path in routes:
            reply = http.request(method, path, json=completion_body())
            assert reply.status_code == 401, (method, path, reply.status_code)
            assert reply.json()["error"]["code"] == "invalid_api_key"
            assert reply.headers["WWW-Authenticate"] == "Bearer"
    with httpx.Client(base_url=service.url, headers=AUTH, timeout=30) as http:
        assert http.get("/v1/models").status_code == 200


class Trap:
    """Unpickling this creates MARKER: proof that someone unpickled client data."""

    MARKER = Path("/tmp/windserve-reliability-unpickled")

    def __reduce__(self):
        return (Path.touch, (self.MARKER,))


def test_pickles_are_text_never_objects(service: Service):
    Trap.MARKER.unlink(missing_ok=True)
    payload = pickle.dumps(Trap())
    with service.client() as http:
        as_text = http.post("/v1/completions", json=completion_body(payload.decode("latin-1"), max_tokens=2))
        as_ids = http.post("/v1/completions", json=completion_body(list(payload), max_tokens=2))
        as_body = http.post("/v1/completions", content=payload, headers={"Content-Type": "application/json"})
        as_octets = http.post("/v1/completions", content=payload, headers={"Content-Type": "application/octet-stream"})
    assert as_text.status_code == 200 and as_text.json()["usage"]["completion_tokens"] == 2
    assert as_ids.status_code in (200, 400)
    assert as_body.status_code == as_octets.status_code == 400
    assert not Trap.MARKER.exists()


def test_no_request_data_reaches_pickle_or_object_refs():
    """Grep-level review: the HTTP layer never unpickles, evaluates, or dereferences what clients send."""
    forbidden = re.compile(r"\b(pickle|cloudpickle|marshal|ObjectRef|ray\.get|ray\.put|eval|exec)\s*[.(]")
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in sorted((REPO / "app").glob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if forbidden.search(line)]
    assert not hits, hits


def test_logprobs_of_the_first_token_cross_from_the_context_side(service: Service):
    """Found by the fuzzer: the disaggregated first token had no logprob, and a logprobs request was a 500."""
    with service.client() as http:
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 3, "logprobs": True,
                                                       "top_logprobs": 2, "messages": [{"role": "system"}],
                                                       "temperature": 0, "ignore_eos": True})  # 3 tokens, always
        completion = http.post("/v1/completions", json=completion_body("Hi", max_tokens=3, logprobs=2))
    assert chat.status_code == 200, chat.text
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(isinstance(e["logprob"], float) and len(e["top_logprobs"]) == 2 for e in content)
    assert completion.status_code == 200, completion.text
    assert len(completion.json()["choices"][0]["logprobs"]["token_logprobs"]) == 3


def test_edges_the_fuzzer_found_are_400_or_200(service: Service):
    """Found by the fuzzer: a token id past the vocabulary, a subnormal temperature or top_p were 500s."""
    from engine.model_registry import resolve_model_path
    from engine.tokenizer import Tokenizer

    vocab_size = Tokenizer(resolve_model_path(MODEL)).vocab_size
    with service.client() as http:
        past_vocab = http.post("/v1/completions", json=completion_body([vocab_size], max_tokens=2))
        tiny_temperature = http.post("/v1/completions", json=completion_body("Hi", max_tokens=2, temperature=1e-300))
        tiny_top_p = http.post("/v1/completions", json=completion_body("Hi", max_tokens=2, temperature=1, top_p=5e-190))
    assert past_vocab.status_code == 400 and past_vocab.json()["error"]["param"] == "prompt"
    assert tiny_temperature.status_code == 200, tiny_temperature.text
    assert tiny_top_p.status_code == 200, tiny_top_p.text
