"""EngineLoop without Ray: a prefill returns its parked update, or raises if it never parks."""

from __future__ import annotations

import asyncio

import pytest

from actors.engine_loop import EngineLoop
from engine import SamplingParams
from tests.engine.engine_fixtures import make_engine, tiny_model  # noqa: F401

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)


def test_prefill_returns_the_parked_result_and_abort_frees_it(tiny_model):
    engine = make_engine(tiny_model, role="context", tokens_per_block=8)

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        result = (await loop.prefill("p", list(range(20)), GREEDY)).prefill
        tables = {g.name: engine.manager.get_block_ordinals("p", g.name) for g in engine.manager.spec.groups}
        assert result.block_ordinals == tables and result.num_prompt_tokens == 20
        assert await loop.abort("p")

    asyncio.run(run())
    engine.manager.check_integrity()
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_prefill_aborted_before_it_parks_raises(tiny_model):
    engine = make_engine(tiny_model, role="context", tokens_per_block=8)

    async def run():
        loop = EngineLoop(engine)  # not started: the request stays waiting until aborted
        task = asyncio.ensure_future(loop.prefill("p", list(range(20)), GREEDY))
        while not engine.has_unfinished():
            await asyncio.sleep(0)
        assert await loop.abort("p")
        with pytest.raises(RuntimeError, match="prefill of 'p' failed: abort"):
            await task

    asyncio.run(run())
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_every_step_runs_on_the_one_named_step_thread(tiny_model):
    """Steps leave the event loop's thread, always for the same thread, which the OS knows as engine-step."""
    import sys
    import threading

    engine = make_engine(tiny_model, tokens_per_block=8)
    seen = []
    step = engine.step

    def recording_step():
        thread = threading.current_thread()
        name = None
        if sys.platform.startswith("linux"):
            with open(f"/proc/self/task/{thread.native_id}/comm") as comm:
                name = comm.read().strip()
        seen.append((thread.ident, name))
        return step()

    engine.step = recording_step

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        tokens = []
        async for update in loop.generate("r", list(range(12)), GREEDY):
            tokens.extend(update.new_token_ids)
        return tokens, threading.get_ident()

    tokens, loop_thread = asyncio.run(run())
    assert len(tokens) == 4 and len(seen) >= 4  # a prefill step, then a step per further token
    assert {ident for ident, _ in seen} != {loop_thread} and len({ident for ident, _ in seen}) == 1
    if sys.platform.startswith("linux"):
        assert {name for _, name in seen} == {"engine-step"}
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_steps_go_on_while_the_event_loop_is_busy(tiny_model):
    """The step thread does not wait for the event loop between steps: with the loop blocked for 0.5 s
    right after the first token, the engine kept stepping, and the tokens that queued meanwhile come
    merged, in order, the same tokens as an unblocked run."""
    import time

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = list(range(3, 30))

    def run(block_s: float):
        engine = make_engine(tiny_model, tokens_per_block=8)
        step, steps_at = engine.step, []

        def stamped_step():
            updates = step()
            steps_at.append(time.monotonic())
            return updates

        engine.step = stamped_step

        async def go():
            loop = EngineLoop(engine)
            loop.start()
            updates, blocked = [], None
            async for update in loop.generate("r", prompt, params):
                updates.append(update)
                if blocked is None and block_s:
                    began = time.monotonic()
                    time.sleep(block_s)  # the event loop's thread is busy; no await
                    blocked = (began, time.monotonic())
            return updates, blocked

        updates, blocked = asyncio.run(go())
        assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
        return updates, blocked, steps_at

    plain, _, _ = run(0.0)
    updates, (began, ended), steps_at = run(0.5)
    tokens = [t for u in updates for t in u.new_token_ids]
    assert tokens == [t for u in plain for t in u.new_token_ids] and len(tokens) == 24
    assert sum(began < t < ended for t in steps_at) >= 5  # stepped while the loop could not ask it to
    assert len(updates) < len(plain)  # what queued meanwhile came as fewer, merged updates


def test_updates_a_call_returns_reach_the_queue_before_any_later_steps(tiny_model):
    """call_and_deliver (a generation worker adding a prefilled request with the context side's
    outputs): those updates are first in the request's stream, though the step thread may step
    the request before the caller resumes."""
    from engine import RequestUpdate

    engine = make_engine(tiny_model, tokens_per_block=8)
    marker = RequestUpdate("r", [], "<handed over>", 20, 0)

    def add():
        engine.add_request("r", list(range(20)), GREEDY)
        return [marker]

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        queue = loop.watch("r")
        await loop.call_and_deliver(add)
        return [update async for update in loop.stream("r", queue)]

    updates = asyncio.run(run())
    assert updates[0].new_text.startswith("<handed over>")
    assert sum(len(u.new_token_ids) for u in updates) == 4 and updates[-1].is_finished
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()


def test_a_caller_gone_while_its_request_was_being_added_leaves_nothing_running(tiny_model):
    """The add runs on the step thread; a caller cancelled while it ran gets CancelledError, and the
    request it added is aborted behind it: nothing keeps running, every page is free."""
    import threading

    engine = make_engine(tiny_model, tokens_per_block=8)
    adding, release = threading.Event(), threading.Event()
    add = engine.add_request

    def slow_add(*args, **kwargs):
        adding.set()
        release.wait(10)
        return add(*args, **kwargs)

    engine.add_request = slow_add

    async def run():
        loop = EngineLoop(engine)
        loop.start()
        task = asyncio.ensure_future(anext(loop.generate("r", list(range(20)), GREEDY)))
        while not adding.is_set():
            await asyncio.sleep(0.001)
        task.cancel()  # the add is running on the step thread
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await loop.call(engine.has_unfinished) is False

    asyncio.run(run())
    assert engine.manager.num_free_pages() == engine.manager.num_total_pages()
