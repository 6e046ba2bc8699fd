"""``n`` choices (app.choices) through the official openai client, against a live server on fakes.

The fake backend stands in for the workers, so these tests check the fan-out itself: which child
requests the backend receives (ids, seeds), when each starts, what the client assembles, and that
every unfinished child is aborted when one fails or the client leaves. The real model's tokens and
the prefix cache's hits are tests/app/test_smollm2_n.py's.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.choices import SEED_SPACE, child_seed
from app.protocol import MAX_N
from tests.app.fakes import FAIL_TRIGGER, MODEL, REPLY, ByteTokenizer, FakeBackend, openai_client, wait_until

MESSAGES = [{"role": "user", "content": "Hi"}]


class RecordingBackend(FakeBackend):
    """A FakeBackend that logs ``("start", id)`` when a request's call begins and ``("update", id)``
    per update; a request id ending in ``fail_suffix`` fails at its third token."""

    def __init__(self, fail_suffix: str | None = None, **options) -> None:
        super().__init__(**options)
        self.events: list[tuple[str, str]] = []
        self.fail_suffix = fail_suffix

    async def generate(self, request_id, prompt_token_ids, params):
        self.events.append(("start", request_id))
        async for update in super().generate(request_id, prompt_token_ids, params):
            if self.fail_suffix and request_id.endswith(self.fail_suffix) and update.num_output_tokens == 3:
                update.finish_reason, update.error = "error", "KV transfer failed"
            self.events.append(("update", request_id))
            yield update
            if update.is_finished:
                return


@given(seed=st.integers(-(2**63), SEED_SPACE - 1), index=st.integers(0, MAX_N - 1))
def test_a_child_seed_is_seed_plus_index_within_the_seed_range(seed, index):
    derived = child_seed(seed, index)
    assert -(2**63) <= derived < SEED_SPACE
    assert derived == seed + index or (seed + index >= SEED_SPACE and derived == seed + index - SEED_SPACE)
    assert child_seed(None, index) is None


def test_completion_choices_usage_and_children(make_server):
    backend = RecordingBackend()
    client = openai_client(make_server(backend=backend).url)
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, n=3, seed=41, logprobs=1,
                                      temperature=0.7)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.text == REPLY[:5] and c.finish_reason == "length" for c in reply.choices)
    assert all(c.logprobs.text_offset == [0, 1, 2, 3, 4] for c in reply.choices)  # each choice counts its own
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (5, 15, 20)
    children = [f"{reply.id}-{i}" for i in range(3)]
    assert sorted(rid for rid in backend.requests if rid.startswith(reply.id)) == children
    assert [backend.requests[rid][1].seed for rid in children] == [41, 42, 43]
    assert {backend.requests[rid][1].temperature for rid in children} == {0.7}


def test_children_start_once_child_zero_has_its_first_update(make_server):
    backend = RecordingBackend(token_delay_s=0.01)
    client = openai_client(make_server(backend=backend).url)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, n=4)
    events = [(kind, rid) for kind, rid in backend.events if rid.startswith(reply.id)]
    first_of_child_0 = events.index(("update", f"{reply.id}-0"))
    assert events[0] == ("start", f"{reply.id}-0")
    assert all(events.index(("start", f"{reply.id}-{i}")) > first_of_child_0 for i in range(1, 4))
    assert [backend.requests[f"{reply.id}-{i}"][1].seed for i in range(4)] == [None] * 4  # unseeded: independent


def test_streamed_choices_assemble_to_the_whole(make_server):
    client = openai_client(make_server(backend=FakeBackend()).url)
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=3, seed=1)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, n=3, seed=1,
                                                 stream=True, stream_options={"include_usage": True}))
    texts, roles, finishes = ["", "", ""], [[], [], []], [[], [], []]
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        roles[choice.index] += [choice.delta.role] if choice.delta.role else []
        finishes[choice.index] += [choice.finish_reason] if choice.finish_reason else []
    assert texts == [c.message.content for c in whole.choices] == [REPLY[:6]] * 3
    assert roles == [["assistant"]] * 3 and finishes == [["length"]] * 3
    assert len({chunk.id for chunk in chunks}) == 1 and len({chunk.created for chunk in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == len(ByteTokenizer().apply_chat_template(
        MESSAGES))


def test_usage_counts_the_prompt_once_with_child_zeros_cached_tokens(make_server):
    """The fake caches by 16-token blocks: child 0 of a new 40-token prompt hits nothing; the usage
    reports its hit, not the children's (each of which finds child 0's two blocks)."""
    backend = FakeBackend(tokens_per_block=16)
    client = openai_client(make_server(backend=backend).url)
    reply = client.completions.create(model=MODEL, prompt="s" * 40, max_tokens=2, n=4)
    assert reply.usage.prompt_tokens == 40 and reply.usage.prompt_tokens_details.cached_tokens == 0
    assert (backend.num_queried_tokens, backend.num_hit_tokens) == (4 * 40, 3 * 32)


def test_one_failing_child_fails_the_reply_and_aborts_the_others(make_server):
    backend = RecordingBackend(fail_suffix="-1", token_delay_s=0.02)
    client = openai_client(make_server(backend=backend).url)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=200, n=3)
    (reply_id,) = {rid.rsplit("-", 1)[0] for rid in backend.requests}
    assert wait_until(lambda: sorted(backend.aborted) == [f"{reply_id}-0", f"{reply_id}-2"])


def test_a_stream_with_a_failing_child_ends_with_an_error_event(make_server):
    backend = RecordingBackend(fail_suffix="-2", token_delay_s=0.01)
    live = make_server(backend=backend)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 100, "n": 3, "stream": True}
    raw = httpx.post(f"{live.url}/v1/completions", json=body, timeout=10).text
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and '"error"' in events[-3] and "KV transfer failed" in events[-3]
    assert wait_until(lambda: len(backend.aborted) == 2 and not any(rid.endswith("-2") for rid in backend.aborted))


def leave_early(url: str, body: dict) -> None:
    """Send ``body`` and leave: after 8 SSE lines when streamed, else after a 0.5 s read timeout."""
    if body["stream"]:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=10) as reply:
            lines = reply.iter_lines()
            for _ in range(8):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_every_child(make_server, stream):
    backend = RecordingBackend(token_delay_s=0.02)
    live = make_server(backend=backend)
    leave_early(live.url, {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "n": 4, "stream": stream})
    assert wait_until(lambda: len(backend.requests) == 4 and sorted(backend.aborted) == sorted(backend.requests))


@pytest.mark.parametrize("n", [0, -1, MAX_N + 1])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_n_outside_its_range_is_a_400_naming_n(client, n, endpoint):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=MESSAGES, n=n)
        else:
            client.completions.create(model=MODEL, prompt="x", n=n)
    assert info.value.param == "n" and str(1 if n < 1 else MAX_N) in info.value.message


def test_n_at_its_bound_is_served(client):
    reply = client.completions.create(model=MODEL, prompt="x", max_tokens=2, n=MAX_N)
    assert [c.index for c in reply.choices] == list(range(MAX_N))
