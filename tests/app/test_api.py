"""The HTTP API through the official openai client, against a live server."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.api import build_api
from tests.app.fakes import (
    FAIL_TRIGGER,
    MAX_MODEL_LEN,
    MODEL,
    RAISE_TRIGGER,
    REPLY,
    SECRET,
    ByteTokenizer,
    FakeBackend,
    openai_client,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def sent(backend: FakeBackend, request_id: str):
    """(prompt_token_ids, SamplingParams) the backend received for a request."""
    return backend.requests[request_id]


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("other-model")
    assert info.value.code == "model_not_found"


def test_completion_text_usage_and_id(client, backend):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=10)
    assert reply.id.startswith("cmpl-") and len(reply.id) == len("cmpl-") + 32
    assert reply.object == "text_completion"
    assert reply.choices[0].text == REPLY[:10]
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 10, 15)
    assert sent(backend, reply.id)[0] == list(b"Hello")


def test_completion_accepts_token_ids_and_a_batch_of_one(client, backend):
    reply = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=3)
    assert sent(backend, reply.id)[0] == [7, 8, 9] and reply.usage.prompt_tokens == 3
    reply = client.completions.create(model=MODEL, prompt=["Hi"], max_tokens=3)
    assert sent(backend, reply.id)[0] == list(b"Hi")


def test_sampling_fields_reach_the_backend(client, backend):
    reply = client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, temperature=0.5, top_p=0.9, seed=7, stop=["zz", "yy"],
        extra_body={"top_k": 3, "ignore_eos": True, "response_format": {"type": "text"}, "unknown": [1]},
    )
    params = sent(backend, reply.id)[1]
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (5, 0.5, 0.9, 7)
    assert (params.stop, params.top_k, params.ignore_eos, params.logprobs) == (("zz", "yy"), 3, True, None)


def test_null_fields_mean_defaults(http, backend):
    nulls = dict.fromkeys(["temperature", "top_p", "max_tokens", "stop", "n", "seed", "stream", "stream_options"])
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **nulls})
    assert reply.status_code == 200
    assert sent(backend, reply.json()["id"])[1].max_tokens == 16
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "logprobs": None, "top_logprobs": None})
    assert reply.status_code == 200


def test_stop_string_ends_the_text(client):
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=30, stop="fox")
    assert reply.choices[0].text == "The quick brown "
    assert reply.choices[0].finish_reason == "stop"


def test_max_tokens_is_clamped_to_the_context(client, backend):
    reply = client.completions.create(model=MODEL, prompt="abcd", max_tokens=10**9)
    assert sent(backend, reply.id)[1].max_tokens == MAX_MODEL_LEN - 4
    assert reply.usage.completion_tokens == MAX_MODEL_LEN - 4


def test_chat_completion_renders_the_template(client, backend):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert reply.id.startswith("chatcmpl-") and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == REPLY[:12]
    prompt = ByteTokenizer().apply_chat_template(MESSAGES)
    assert sent(backend, reply.id)[0] == prompt
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(prompt), 12)


def test_chat_content_parts_equal_plain_text(client, backend):
    parts = [{"type": "text", "text": "H"}, {"type": "text", "text": "i"}]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": parts}])
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert sent(backend, reply.id)[0] == sent(backend, plain.id)[0]


def test_chat_max_tokens_precedence_and_default(client, backend):
    both = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, max_completion_tokens=4
    )
    assert sent(backend, both.id)[1].max_tokens == 4
    neither = client.chat.completions.create(model=MODEL, messages=MESSAGES)
    prompt_ids, params = sent(backend, neither.id)
    assert params.max_tokens == MAX_MODEL_LEN - len(prompt_ids)


def test_streamed_completion_concatenates_to_the_whole(client):
    request = {"model": MODEL, "prompt": "Hi", "max_tokens": 40, "stop": "over"}
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(**request, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)


def test_streamed_chat_deltas_and_usage(client):
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=15)
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=15, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completion_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=4, logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == list(REPLY[:4]) and logprobs.token_logprobs == [-0.25] * 4
    assert [len(top) for top in logprobs.top_logprobs] == [2] * 4
    assert logprobs.text_offset == [0, 1, 2, 3]


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1
    )
    content = reply.choices[0].logprobs.content
    assert [entry.token for entry in content] == list(REPLY[:3])
    assert [len(entry.top_logprobs) for entry in content] == [1, 1, 1]
    assert content[0].bytes == list(REPLY[0].encode())


@pytest.mark.parametrize(
    "kwargs, param, needle",
    [
        ({"prompt": "x", "n": 17}, "n", "less than or equal to 16"),
        ({"prompt": ["a", "b"]}, "prompt", "one prompt"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "x", "max_tokens": -1}, "max_tokens", ""),
        ({"prompt": "x", "temperature": 5}, "temperature", ""),
        ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
        ({"prompt": "x", "extra_body": {"echo": True}}, "echo", "echo"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "prompt", "maximum context length"),
    ],
)
def test_invalid_completion_is_400(client, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, **kwargs)
    error = info.value
    assert error.status_code == 400 and error.type == "invalid_request_error"
    assert error.param == param and needle in error.message
    assert set(error.response.json()["error"]) == {"message", "type", "param", "code"}


def test_invalid_chat_is_400(client, make_server):
    for messages in ([], [{"role": "wizard", "content": "x"}]):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=messages)
        assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, top_logprobs=2)
    assert info.value.param == "top_logprobs"
    no_template = openai_client(make_server(tokenizer=ByteTokenizer(has_template=False)).url)
    with pytest.raises(openai.BadRequestError) as info:
        no_template.chat.completions.create(model=MODEL, messages=MESSAGES)
    assert "chat template" in info.value.message


def test_context_length_code(client):
    with pytest.raises(openai.BadRequestError) as info:
        long_message = {"role": "user", "content": "x" * MAX_MODEL_LEN}
        client.chat.completions.create(model=MODEL, messages=[long_message])
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="x")
    assert (info.value.status_code, info.value.code, info.value.param) == (404, "model_not_found", "model")


def test_unknown_route_and_bad_json(http):
    for reply in (http.get("/v1/nope"), http.post("/nope", json={})):
        assert reply.status_code == 404 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    reply = http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"
    reply = http.get("/v1/completions")
    assert reply.status_code == 405 and "error" in reply.json()


def test_backend_failures_are_500_without_internals(client):
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt=RAISE_TRIGGER)
    assert info.value.status_code == 500 and SECRET not in info.value.response.text
    assert info.value.response.json()["error"]["message"] == "Internal server error"
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=MODEL, prompt=FAIL_TRIGGER)
    assert info.value.response.json()["error"]["message"] == "KV transfer failed"
    assert info.value.type == "server_error"


def test_api_key_guards_v1_but_not_health(make_server):
    live = make_server(api_key="s3cret")
    with pytest.raises(openai.AuthenticationError) as info:
        openai_client(live.url, api_key="wrong").models.list()
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    reply = httpx.post(f"{live.url}/v1/chat/completions", json={})
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert openai_client(live.url, api_key="s3cret").models.list().data[0].id == MODEL
    assert httpx.get(f"{live.url}/health").status_code == 200


def test_over_max_queue_is_503_with_retry_after(make_server):
    backend = FakeBackend(token_delay_s=0.02)
    live = make_server(backend=backend, max_queue=1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=live.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # held: dropping the iterator closes the stream
            next(lines)  # the first request is now in flight
            with pytest.raises(openai.InternalServerError) as info:
                openai_client(live.url).completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert info.value.status_code == 503 and info.value.code == "overloaded"
        assert info.value.response.headers["retry-after"] == "1"
    reply = openai_client(live.url).completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert reply.choices[0].text == REPLY[0]


def test_health_follows_the_backend(make_server):
    backend = FakeBackend()
    live = make_server(backend=backend)
    assert httpx.get(f"{live.url}/health").status_code == 200
    backend.is_healthy = False
    reply = httpx.get(f"{live.url}/health")
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unhealthy"


def test_metrics_exposition(make_server):
    live = make_server()
    client = openai_client(live.url)
    client.completions.create(model=MODEL, prompt="x", max_tokens=5)
    list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True))
    httpx.post(f"{live.url}/v1/completions", json={"prompt": "x", "n": 17})
    text = httpx.get(f"{live.url}/metrics").text
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }
    requests = "windserve_http_requests_total"
    assert samples[(requests, (("route", "/v1/completions"), ("status", "200")))] == 1
    assert samples[(requests, (("route", "/v1/completions"), ("status", "400")))] == 1
    assert samples[(requests, (("route", "/v1/chat/completions"), ("status", "200")))] == 1
    assert samples[("windserve_time_to_first_token_seconds_count", ())] == 2
    assert samples[("windserve_time_per_output_token_seconds_count", ())] == 2
    assert samples[("windserve_generation_tokens_total", ())] == 10
    gen, ctx = (("role", "generation"), ("worker", "gen-0")), (("role", "context"), ("worker", "ctx-0"))
    assert samples[("windserve_kv_pages_in_use", gen)] == 12
    assert samples[("windserve_kv_pages_free", ctx)] == 61
    assert samples[("windserve_kv_transfer_bytes_total", ctx)] == 4096
    assert samples[("windserve_spec_draft_tokens_accepted_total", gen)] == 25
    assert samples[("windserve_kv_transfer_fallbacks_total", gen)] == 2
    assert samples[("windserve_kv_transfers_total", gen)] == 7
    assert ("windserve_kv_transfer_bytes_total", gen) not in samples


def test_apps_have_separate_registries():
    first, second = build_api(FakeBackend(), ByteTokenizer()), build_api(FakeBackend(), ByteTokenizer())
    assert first.state.serving.metrics.registry is not second.state.serving.metrics.registry


def cached_tokens(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def test_usage_reports_cached_tokens_streamed_and_not(make_server):
    """The backend's ``num_cached_tokens`` reaches OpenAI's ``usage.prompt_tokens_details``, parsed by the SDK.

    The fake caches by 16-token blocks: a 40-token prompt shares its first 32 tokens with a later one.
    """
    client = openai_client(make_server(backend=FakeBackend(tokens_per_block=16)).url)
    system = "s" * 40
    first = client.completions.create(model=MODEL, prompt=system, max_tokens=3)
    assert cached_tokens(first.usage) == 0 and first.usage.prompt_tokens == 40
    again = client.completions.create(model=MODEL, prompt=system + " next", max_tokens=3)
    assert cached_tokens(again.usage) == 32
    streamed = list(client.completions.create(model=MODEL, prompt=system + " third", max_tokens=3, stream=True,
                                              stream_options={"include_usage": True}))
    assert streamed[-1].choices == [] and cached_tokens(streamed[-1].usage) == 32  # shares 41 tokens: 2 blocks

    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    prompt_len = len(ByteTokenizer().apply_chat_template(messages))
    assert cached_tokens(chat.usage) == 0 and chat.usage.prompt_tokens == prompt_len == 75
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, stream=True,
                                                 stream_options={"include_usage": True}))
    assert cached_tokens(chunks[-1].usage) == (prompt_len - 1) // 16 * 16 == 64


def test_usage_without_a_cache_reports_zero_cached_tokens(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def prefix_cache_samples(url: str) -> dict[str, float]:
    """{series: value} of worker ctx-0's prefix-cache counters."""
    text = httpx.get(f"{url}/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("windserve_prefix_cache_") and s.labels == {"worker": "ctx-0", "role": "context"}}


def test_prefix_cache_counters_appear_and_grow(make_server):
    live = make_server(backend=FakeBackend(tokens_per_block=16))
    client = openai_client(live.url)
    queries, hits = "windserve_prefix_cache_queries_total", "windserve_prefix_cache_hits_total"
    assert prefix_cache_samples(live.url) == {queries: 0, hits: 0}
    client.completions.create(model=MODEL, prompt="p" * 50, max_tokens=1)
    assert prefix_cache_samples(live.url) == {queries: 50, hits: 0}
    client.completions.create(model=MODEL, prompt="p" * 50 + "q" * 10, max_tokens=1)
    assert prefix_cache_samples(live.url) == {queries: 110, hits: 48}
