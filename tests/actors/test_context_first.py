"""The context worker's first update, without Ray: exactly what an aggregated engine emits for
the handed-over outputs (engine.handoff: up to the first visible text), merged into one update;
when an output ends the request nothing is held (no lease, pages free)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from actors import worker_base
from actors.config import WorkerConfig
from actors.context_worker import ContextWorker
from actors.transport import LocalFabric, LocalTransport
from engine import SamplingParams
from engine.handoff import HANDOFF_MAX_TOKENS
from engine.outputs import RequestUpdate
from tests.engine.engine_fixtures import make_engine, tiny_model  # noqa: F401

B = 8
PROMPT = list(b"The capital of France is")  # windserve-tiny's tokens are bytes; greedy, its first is "4"
ENGINE = dict(device="cpu", tokens_per_block=B, num_pages=64, enable_prefix_caching=False)  # cases share prompts
SPLIT = [(5 * i + 3) % 256 for i in range(30)]  # greedy, its first token is half a UTF-8 character


@pytest.fixture(scope="module")
def context() -> ContextWorker:
    """A context worker in this process (its transport on a fabric of its own; nothing pulls here)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_base, "make_transport", lambda kind, name: LocalTransport(name, LocalFabric()))
        return ContextWorker(WorkerConfig(**ENGINE, transport="local"))


def aggregated_first(tiny_model, prompt: list[int], params: SamplingParams, request_id: str = "r",
                     num_tokens: int = 1) -> RequestUpdate:
    """The aggregated engine's updates of the first ``num_tokens`` outputs, merged into one."""
    engine = make_engine(tiny_model, **ENGINE)
    engine.add_request(request_id, prompt, params)
    merged = None
    while merged is None or (merged.num_output_tokens < num_tokens and not merged.is_finished):
        for update in engine.step():
            merged = update if merged is None else merge(merged, update)
    engine.abort(request_id)
    return merged


def merge(a: RequestUpdate, b: RequestUpdate) -> RequestUpdate:
    logprobs = None if a.logprobs is None else a.logprobs + b.logprobs
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text,
                               logprobs=logprobs)


def prefill(context: ContextWorker, request_id: str, prompt: list[int], params: SamplingParams):
    async def run():
        context.loop.start()
        try:
            return await context.prefill(request_id, prompt, params)
        finally:
            context.loop.stop()

    return asyncio.run(run())


def first_text(tiny_model) -> str:
    return aggregated_first(tiny_model, PROMPT, SamplingParams(max_tokens=4, ignore_eos=True)).new_text


def is_free(context: ContextWorker) -> bool:
    manager = context.engine.manager
    manager.check_integrity()
    return manager.num_free_pages() == manager.num_total_pages() and len(context.leases) == 0


@pytest.mark.parametrize("case", ["greedy", "seeded-logprobs", "max_tokens=1", "stop completed", "stop held back",
                                  "half a character", "half a character, max_tokens=1"])
def test_first_update_is_the_aggregated_first_update(case, context, tiny_model):
    text = first_text(tiny_model)
    assert text == "4", "the stop cases need the first token's text"
    params = {
        "greedy": SamplingParams(max_tokens=8, ignore_eos=True),
        "seeded-logprobs": SamplingParams(max_tokens=8, temperature=0.9, seed=7, logprobs=3, ignore_eos=True),
        "max_tokens=1": SamplingParams(max_tokens=1, ignore_eos=True, logprobs=1),
        "stop completed": SamplingParams(max_tokens=8, stop=[text], ignore_eos=True),
        "stop held back": SamplingParams(max_tokens=8, stop=[text + "\x01\x02"], ignore_eos=True),
        "half a character": SamplingParams(max_tokens=8, ignore_eos=True),
        "half a character, max_tokens=1": SamplingParams(max_tokens=1, ignore_eos=True),  # finished: flushed
    }[case]
    prompt = SPLIT if case.startswith("half a character") else PROMPT
    got = prefill(context, case, prompt, params)  # an id once per worker: leases remember it
    k = len(got.first.new_token_ids)
    want = aggregated_first(tiny_model, prompt, params, case, num_tokens=k)
    assert got.first == want
    assert got.first.new_token_ids == want.new_token_ids and want.num_output_tokens == k
    if case in ("stop held back", "half a character"):  # text could still become a stop string, a character
        assert k > 1 and not got.is_finished  # so the context side decoded on
        assert got.first.new_text != "" or k == HANDOFF_MAX_TOKENS
    else:
        assert k == 1
    if case == "half a character, max_tokens=1":
        assert got.first.new_text == "\ufffd"
    if case in ("max_tokens=1", "stop completed", "half a character, max_tokens=1"):
        assert got.is_finished and got.kv is None and is_free(context)
        assert got.first.finish_reason == ("stop" if case == "stop completed" else "length")
    else:
        assert got.kv.output_token_ids == want.new_token_ids and got.kv.request_id == case
        assert got.kv.num_kv_tokens == len(prompt) + k - 1
        assert len(context.leases) == 1 and not is_free(context)
        asyncio.run(context.abort(case))
        assert is_free(context)
