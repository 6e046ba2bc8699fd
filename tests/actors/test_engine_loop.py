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
