"""The SSE wire format, client disconnects, and fuzzed request bodies (raw httpx)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.api import build_api
from engine.outputs import merge_updates
from tests.app.fakes import (
    FAIL_TRIGGER,
    MAX_MODEL_LEN,
    MODEL,
    REPLY,
    ByteTokenizer,
    FakeBackend,
    wait_until,
)

ERROR_KEYS = {"message", "type", "param", "code"}


def sse_payloads(raw: bytes) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking every event's framing."""
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.decode("utf-8").split("\n\n")
    assert events[-1] == ""
    assert all(event.startswith("data: ") and "\n" not in event for event in events[:-1])
    return [event[len("data: "):] for event in events[:-1]]


def test_completion_stream_wire_format(http):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 6, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(reply.read())
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == REPLY[:6]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 6 + ["length"]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1


def test_chat_stream_wire_format_with_usage(http):
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "stream": True, "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as reply:
        chunks = [json.loads(p) for p in sse_payloads(reply.read())[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:4]] == [{"content": ch} for ch in REPLY[:3]]
    assert chunks[4]["choices"][0] | {"delta": None} == {
        "index": 0, "delta": None, "logprobs": None, "finish_reason": "length"
    }
    assert chunks[5]["choices"] == [] and chunks[5]["usage"]["completion_tokens"] == 3
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_failure_after_headers_is_an_error_event(http):
    body = {"model": MODEL, "prompt": FAIL_TRIGGER, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        payloads = sse_payloads(reply.read())
    assert reply.status_code == 200
    assert json.loads(payloads[-2])["error"]["message"] == "KV transfer failed"


def test_disconnect_mid_stream_aborts(make_server):
    backend = FakeBackend(token_delay_s=0.02)
    live = make_server(backend=backend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=live.url, timeout=10) as http:
        with http.stream("POST", "/v1/completions", json=body) as reply:
            lines = reply.iter_lines()
            request_id = json.loads(next(lines)[len("data: "):])["id"]
            next(lines)
        assert wait_until(lambda: request_id in backend.aborted, timeout_s=5)
        in_flight = lambda: "windserve_requests_in_flight 0.0" in http.get("/metrics").text  # noqa: E731
        assert wait_until(in_flight, timeout_s=5)


def test_disconnect_before_a_whole_reply_aborts(make_server):
    backend = FakeBackend(token_delay_s=0.02)
    live = make_server(backend=backend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 200}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.2))
    assert wait_until(lambda: len(backend.aborted) == 1, timeout_s=5)
    assert backend.aborted == list(backend.requests)


def test_finished_requests_are_not_aborted(make_server):
    backend = FakeBackend()
    live = make_server(backend=backend)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
    assert httpx.post(f"{live.url}/v1/completions", json=body).status_code == 200
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body | {"stream": True}) as reply:
        reply.read()
    assert len(backend.requests) == 2 and backend.aborted == []


# ---- fuzzing: whatever the body, never a 500 and always OpenAI's error shape

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
chat_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values},
        optional={"content": st.text(max_size=40) | json_values, "name": st.text(max_size=5)},
    ),
    max_size=3,
)
# Field -> values: mostly plausible, sometimes out of range, sometimes of the wrong type.
FIELD_VALUES = {
    "model": st.just(MODEL) | json_values,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 300), max_size=8) | json_values,
    "messages": chat_messages | json_values,
    "max_tokens": st.integers(-(2**64), 2**64) | st.integers(1, 40) | json_values,
    "max_completion_tokens": st.integers(-5, MAX_MODEL_LEN * 2) | json_values,
    "temperature": st.floats(0, 2) | st.floats() | json_values,
    "top_p": st.floats(0, 1) | json_values,
    "n": st.integers(-2, 3) | json_values,
    "seed": st.integers(-(2**70), 2**70) | json_values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=3) | json_values,
    "logprobs": st.integers(-2, 30) | st.booleans() | json_values,
    "top_logprobs": st.integers(-2, 30) | json_values,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
    "unknown_field": json_values,
}
field_overrides = st.lists(
    st.sampled_from(sorted(FIELD_VALUES)).flatmap(lambda key: FIELD_VALUES[key].map(lambda v: (key, v))),
    max_size=3,
).map(dict)
valid_completion = st.fixed_dictionaries({"model": st.just(MODEL), "prompt": st.text(min_size=1, max_size=40)})
valid_chat = st.just({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]})


def overridden(valid: st.SearchStrategy[dict]) -> st.SearchStrategy[bytes]:
    """A valid body with up to three fields replaced."""
    return st.builds(dict.__or__, valid, field_overrides).map(lambda obj: json.dumps(obj).encode())


requests = (
    st.tuples(st.just("/v1/completions"), overridden(valid_completion))
    | st.tuples(st.just("/v1/chat/completions"), overridden(valid_chat))
    | st.tuples(
        st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
        json_values.map(lambda obj: json.dumps(obj).encode()) | st.binary(max_size=64),
    )
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_fuzzed_bodies_never_500(http, request):
    path, body = request
    reply = http.post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code in (200, 400, 404), reply.text
    assert b"Internal server error" not in reply.content
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["type"]


def test_send_failure_under_asgi_2_4_aborts():
    """ASGI >= 2.4 servers report a gone client by failing ``send``, not by a message."""
    backend = FakeBackend(token_delay_s=0.001)
    app = build_api(backend, ByteTokenizer())
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 200, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "root_path": "", "query_string": b"", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
    }
    messages = []

    async def receive():
        if not messages:
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(10)  # a 2.4 server never says "disconnect" here

    async def send(message):
        messages.append(message)
        if len(messages) > 3:
            raise OSError("client gone")

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=5))
    assert list(backend.requests) == backend.aborted and len(backend.aborted) == 1


def test_an_abort_is_not_a_child_of_the_request_it_aborts():
    """Serve cancels the child calls of a cancelled request (a client that disconnected); an abort
    started in that request's context would be one of them and could be cancelled unsent."""
    from ray.serve import context as serve_context

    from app.generation import GenerationRun, ServingContext
    from app.metrics import ServingMetrics
    from engine.params import SamplingParams

    seen: list[object] = []

    class RecordingBackend(FakeBackend):
        async def abort(self, request_id: str) -> None:
            seen.append(serve_context._serve_request_context.get())
            await super().abort(request_id)

    async def leave_early() -> ServingContext:
        ctx = ServingContext(RecordingBackend(), ByteTokenizer(), ServingMetrics())
        serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="parent"))
        async with GenerationRun(ctx, "r1", [104, 105], SamplingParams(max_tokens=50)) as run:
            await anext(run)
        await asyncio.gather(*ctx.pending_aborts)
        return ctx

    ctx = asyncio.run(leave_early())
    assert ctx.backend.aborted == ["r1"]
    assert seen == [None]  # the abort ran outside the request's Serve context


class CoalescingBackend(FakeBackend):
    """FakeBackend's updates merged in runs of ``run_sizes`` (cycled), as a worker whose consumer fell
    behind sends them (actors.engine_loop.next_merged)."""

    def __init__(self, run_sizes: list[int]) -> None:
        super().__init__()
        self.run_sizes = run_sizes

    async def generate(self, request_id, prompt_token_ids, params):
        run, sizes = [], iter(self.run_sizes * 64)
        size = next(sizes)
        async for update in super().generate(request_id, prompt_token_ids, params):
            run.append(update)
            if len(run) == size or update.is_finished:
                yield merge_updates(run)
                run, size = [], next(sizes)


def chat_stream(url: str, max_tokens: int) -> list[dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens,
            "stream": True, "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, timeout=10) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            return [json.loads(p) for p in sse_payloads(reply.read())[:-1]]


@pytest.mark.parametrize("run_sizes", [[3], [1, 4, 2], [50]])
def test_coalesced_updates_stream_the_same_tokens_logprobs_finish_and_usage(make_server, run_sizes):
    """Each merged update is one chunk carrying its run's text and logprobs, in order."""
    one_by_one = chat_stream(make_server().url, 9)
    coalesced = chat_stream(make_server(backend=CoalescingBackend(run_sizes)).url, 9)

    def content(chunks):
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])

    def logprobs(chunks):
        return [entry for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for entry in c["choices"][0]["logprobs"]["content"]]

    assert content(coalesced) == content(one_by_one) == REPLY[:9]
    assert logprobs(coalesced) == logprobs(one_by_one) and len(logprobs(one_by_one)) == 9
    finishes = [c["choices"][0]["finish_reason"] for c in coalesced if c["choices"]]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert coalesced[-1]["usage"] == one_by_one[-1]["usage"]
    runs = [len(entries) for entries in (logprobs([c]) for c in coalesced) if entries]  # tokens per chunk
    expected = [min(size, 9 - sum(runs[:i])) for i, size in enumerate((run_sizes * 9)[:len(runs)])]
    assert runs == expected and sum(runs) == 9
