"""Coalescing on the serving path: a consumer that fell behind gets what queued up as one update,
every token once, in order, with the chunk boundaries of what was queued at each read."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine_loop import EngineLoop, next_merged
from engine import SamplingParams
from engine.outputs import FinishReason, RequestUpdate, TokenLogprob, merge_updates
from tests.engine.engine_fixtures import make_engine, tiny_model  # noqa: F401

RID = "r"


def token_updates(num_tokens_each: list[int], finish: FinishReason | None, with_logprobs: bool) -> list[RequestUpdate]:
    """Consecutive updates of one request: token ids 100, 101, ... each with text "<id>" and a logprob."""
    updates, next_id = [], 100
    for i, n in enumerate(num_tokens_each):
        ids = list(range(next_id, next_id + n))
        next_id += n
        logprobs = [TokenLogprob(t, -t / 1000) for t in ids] if with_logprobs else None
        is_last = i == len(num_tokens_each) - 1
        updates.append(RequestUpdate(RID, ids, "".join(f"<{t}>" for t in ids), 7, next_id - 100,
                                     finish_reason=finish if is_last else None, logprobs=logprobs))
    return updates


def flat(updates: list[RequestUpdate]) -> tuple[list[int], str, list | None]:
    logprobs = None if updates[0].logprobs is None else [lp for u in updates for lp in u.logprobs]
    return [t for u in updates for t in u.new_token_ids], "".join(u.new_text for u in updates), logprobs


sizes = st.lists(st.integers(0, 3), min_size=1, max_size=12)
finishes = st.sampled_from([None, FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT])


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, finish=finishes, with_logprobs=st.booleans())
def test_merge_concatenates_in_order_and_keeps_the_last_finish(sizes, finish, with_logprobs):
    updates = token_updates(sizes, finish, with_logprobs)
    merged = merge_updates(updates)
    ids, text, logprobs = flat(updates)
    assert merged.new_token_ids == ids == list(range(100, 100 + sum(sizes)))
    assert merged.new_text == text and merged.logprobs == logprobs
    assert merged.finish_reason == finish and merged.num_output_tokens == sum(sizes)


def test_merge_refuses_an_update_after_a_finished_one():
    first, second = token_updates([1, 1], None, False)
    first.finish_reason = FinishReason.STOP
    with pytest.raises(ValueError, match="only the last finished"):
        merge_updates([first, second])


@settings(max_examples=60, deadline=None)
@given(sizes=sizes, finish=st.sampled_from([FinishReason.STOP, FinishReason.ABORT]),
       reads=st.lists(st.integers(0, 4), min_size=1, max_size=12), with_logprobs=st.booleans())
def test_a_late_reader_gets_each_queued_run_as_one_update(sizes, finish, reads, with_logprobs):
    """The producer queues ``reads[i]`` updates before the consumer's i-th read (all the rest before
    the last): each read returns exactly the run queued since the previous one, merged."""
    updates = token_updates(sizes, finish, with_logprobs)

    async def run() -> list[tuple[list[RequestUpdate], RequestUpdate]]:
        queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        pending, seen = list(updates), []
        for num_queued in [*reads, len(updates)]:
            run_of = [pending.pop(0) for _ in range(min(max(num_queued, 1), len(pending)))]
            for update in run_of:
                queue.put_nowait(update)
            if not run_of:
                break
            seen.append((run_of, await next_merged(queue)))
        return seen

    seen = asyncio.run(run())
    for run_of, merged in seen:
        assert flat([merged]) == flat(run_of)
        assert merged.finish_reason == run_of[-1].finish_reason
    assert flat([m for _, m in seen]) == flat(updates)
    assert [m.is_finished for _, m in seen] == [False] * (len(seen) - 1) + [True]


class IdleEngine:
    """What EngineLoop.abort and its step loop ask of an engine with nothing running."""

    def abort(self, request_id: str) -> bool:
        return True

    def has_unfinished(self) -> bool:
        return False


def test_abort_behind_a_queued_run_loses_none_of_its_tokens():
    updates = token_updates([1, 2, 1], None, True)

    async def run() -> list[RequestUpdate]:
        loop = EngineLoop(IdleEngine())
        queue = loop.watch(RID)
        loop.deliver(updates)  # accepted by the worker, not yet read by its consumer
        assert await loop.abort(RID)
        return [update async for update in loop.stream(RID, queue)]

    (merged,) = asyncio.run(run())
    assert flat([merged]) == flat(updates)
    assert merged.finish_reason == FinishReason.ABORT


def test_a_late_consumer_gets_the_tokens_a_prompt_one_gets(tiny_model):
    """Real engine: one consumer reads every update as it comes, another only after its request ended."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = list(range(3, 40))

    async def consume(loop: EngineLoop, rid: str, is_late: bool) -> list[RequestUpdate]:
        updates = loop.generate(rid, prompt, params)
        first = await anext(updates)
        while is_late and loop.engine.has_unfinished():
            await asyncio.sleep(0.01)
        return [first] + [u async for u in updates]

    async def run() -> tuple[list[RequestUpdate], list[RequestUpdate]]:
        loop = EngineLoop(make_engine(tiny_model, tokens_per_block=8))
        loop.start()
        prompt_reader = await consume(loop, "prompt", is_late=False)
        late_reader = await consume(loop, "late", is_late=True)
        return prompt_reader, late_reader

    prompt_reader, late_reader = asyncio.run(run())
    assert flat(late_reader)[:2] == flat(prompt_reader)[:2]
    assert len(flat(late_reader)[0]) == 12
    assert late_reader[-1].finish_reason == prompt_reader[-1].finish_reason == FinishReason.LENGTH
    assert len(late_reader) < len(prompt_reader)  # what queued while it slept came merged
    assert late_reader[-1].num_output_tokens == 12


def test_traced_updates_carry_their_hop_times_in_order_and_untraced_ones_none(tiny_model, monkeypatch):
    """WINDSERVE_TRACE_PATH=1: each update leaves the engine loop with step_start <= step_end <=
    loop_get; unset (the default), no update carries stamps and the SSE chunks get no debug field."""
    from app.streaming import traced

    async def updates_of(loop: EngineLoop) -> list[RequestUpdate]:
        loop.start()
        return [u async for u in loop.generate("t", list(range(3, 20)), SamplingParams(max_tokens=4,
                                                                                        ignore_eos=True))]

    engine = make_engine(tiny_model, tokens_per_block=8)
    plain = asyncio.run(updates_of(EngineLoop(engine)))
    monkeypatch.setenv("WINDSERVE_TRACE_PATH", "1")
    stamped = asyncio.run(updates_of(EngineLoop(engine)))
    assert all(u.stamps is None for u in plain) and traced([{"choices": []}], plain[0]) == [{"choices": []}]
    for update in stamped:
        times = [update.stamps[hop] for hop in ("step_start", "step_end", "loop_get")]
        assert times == sorted(times)
    (chunk,) = traced([{"choices": []}], stamped[0])
    assert chunk["windserve_trace"]["num_tokens"] == len(stamped[0].new_token_ids)
    assert chunk["windserve_trace"]["sse_out"] >= chunk["windserve_trace"]["loop_get"]
    assert [t for u in plain for t in u.new_token_ids] == [t for u in stamped for t in u.new_token_ids]
