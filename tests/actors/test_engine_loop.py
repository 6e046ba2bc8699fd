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
