"""ServeBackend's disaggregated path over in-process fake handles (tests.app.fake_handles, no Ray):
token 0 goes out before the generation call produces anything, the generation stream's repeat
of it is spliced away, and a context side that is gone falls back to a local prefill."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from actors.messages import KVHandle, Prefilled
from app.metrics import ServingMetrics
from app.serve_backend import ServeBackend
from engine.engine import PromptTooLongError
from engine.outputs import FinishReason, RequestUpdate, TokenLogprob
from engine.params import SamplingParams
from tests.app.fake_handles import FakeDeployment, fake_board

PROMPT = [5, 6, 7, 8, 9]
PARAMS = SamplingParams(max_tokens=3, logprobs=1, ignore_eos=True)
LOGPROBS = {10: TokenLogprob(10, -0.5, ((10, -0.5),)), 11: TokenLogprob(11, -1.0, ((11, -1.0),)),
            12: TokenLogprob(12, -1.5, ((12, -1.5),))}


def update(token: int, text: str, finish: FinishReason | None = None) -> RequestUpdate:
    """The aggregated engine's update of output token ``token - 9`` (tokens 10, 11, 12 are "a", "b", "c")."""
    return RequestUpdate("r", [token], text, len(PROMPT), token - 9, finish_reason=finish,
                         logprobs=[LOGPROBS[token]], num_cached_tokens=4)


AGGREGATED = [update(10, "a"), update(11, "b"), update(12, "c", FinishReason.LENGTH)]
KV = KVHandle("context-agent", "r", len(PROMPT), [10], {"full": [3]}, time.time() + 30, 8, [LOGPROBS[10]], 4)


def backend_with(prefill, generate=None, generate_local=None) -> tuple[ServeBackend, dict[str, FakeDeployment]]:
    async def stream_of(*updates):
        for u in updates:
            yield u

    async def default_generate(kv, prompt, params, hint=None):
        async for u in stream_of(*AGGREGATED):  # add_prefilled repeats token 0 first
            yield u

    async def default_local(request_id, prompt, params, hint=None):
        async for u in stream_of(*AGGREGATED):
            yield u

    async def ping():
        return "ok"

    handles = {"context": FakeDeployment({"prefill": prefill, "abort": ping, "ping": ping}),
               "generation": FakeDeployment({"generate": generate or default_generate, "abort": ping, "ping": ping,
                                             "generate_local": generate_local or default_local})}
    return ServeBackend(model_name="m", max_model_len=64, board=fake_board(), **handles), handles


async def prefilled(request_id, prompt, params, hint=None) -> Prefilled:
    return Prefilled(AGGREGATED[0], KV)


async def collect(backend: ServeBackend) -> list[RequestUpdate]:
    return [u async for u in backend.generate("r", PROMPT, PARAMS)]


def test_token_0_goes_out_before_the_generation_call_produces_anything():
    release, produced = asyncio.Event(), []

    async def generate(kv, prompt, params, hint=None):
        await release.wait()
        for u in AGGREGATED:
            produced.append(u)
            yield u

    async def run():
        backend, handles = backend_with(prefilled, generate)
        updates = backend.generate("r", PROMPT, PARAMS)
        first = await asyncio.wait_for(anext(updates), 5)  # never, were token 0 waiting for the generation call
        assert first == AGGREGATED[0] and produced == []
        (call,) = handles["generation"].called("generate")  # opened before the consumer pulls again
        assert call.args == (KV, PROMPT, PARAMS) and call.kwargs["hint"].is_transfer
        release.set()
        rest = [u async for u in updates]
        assert produced == AGGREGATED and not call.is_cancelled
        return [first, *rest]

    assert asyncio.run(run()) == AGGREGATED[:1] + AGGREGATED[1:]  # token 0 once, then tokens 1 and 2 as they came


def test_the_splice_passes_on_only_the_finish_of_the_repeated_token_0():
    """Token 0 ends the request on the generation side only (its max_model_len): the finish and the
    text its flush released pass on; the token, its logprob and the text already sent do not."""
    first = RequestUpdate("r", [10], "a", len(PROMPT), 1, logprobs=[LOGPROBS[10]], num_cached_tokens=4)

    async def held_back(request_id, prompt, params, hint=None):
        return Prefilled(first, KV)

    async def generate(kv, prompt, params, hint=None):
        yield RequestUpdate("r", [10], "a\u00e9", len(PROMPT), 1, FinishReason.LENGTH, [LOGPROBS[10]],
                            num_cached_tokens=4)

    backend, handles = backend_with(held_back, generate)
    updates = asyncio.run(collect(backend))
    assert updates == [first, RequestUpdate("r", [], "\u00e9", len(PROMPT), 1, FinishReason.LENGTH, [],
                                            num_cached_tokens=4)]


def test_a_multi_token_handoff_is_sent_once():
    """Token 0 held back (half a character): the context side hands over tokens 10, 11 in one update;
    the generation stream's first update repeats both (add_prefilled) and only what follows passes."""
    first = RequestUpdate("r", [10, 11], "ab", len(PROMPT), 2, logprobs=[LOGPROBS[10], LOGPROBS[11]],
                          num_cached_tokens=4)
    kv = KVHandle("context-agent", "r", len(PROMPT), [10, 11], {"full": [3]}, time.time() + 30, 8,
                  [LOGPROBS[10], LOGPROBS[11]], 4)

    async def handed_over(request_id, prompt, params, hint=None):
        return Prefilled(first, kv)

    async def generate(kv, prompt, params, hint=None):
        yield first
        yield AGGREGATED[2]

    backend, handles = backend_with(handed_over, generate)
    assert kv.num_kv_tokens == len(PROMPT) + 1
    assert asyncio.run(collect(backend)) == [first, AGGREGATED[2]]
    (call,) = handles["generation"].calls
    assert call.args == (kv, PROMPT, PARAMS)


def test_a_finished_token_0_makes_no_generation_call():
    done = update(10, "a", FinishReason.STOP)

    async def finished(request_id, prompt, params, hint=None):
        return Prefilled(done, None)

    backend, handles = backend_with(finished)
    assert asyncio.run(collect(backend)) == [done]
    assert handles["generation"].calls == []


@pytest.mark.parametrize("error", [ActorDiedError(), ActorUnavailableError("replica unreachable", None),
                                   ReplicaUnavailableError("ContextWorker#abc"),
                                   DeploymentUnavailableError(DeploymentID(name="ContextWorker", app_name="a"))],
                         ids=lambda e: type(e).__name__)
def test_an_unavailable_context_side_falls_back_to_a_local_prefill(error):
    async def unavailable(request_id, prompt, params, hint=None):
        raise error

    backend, handles = backend_with(unavailable)
    assert asyncio.run(collect(backend)) == AGGREGATED
    (call,) = handles["generation"].calls
    assert call.method == "generate_local" and call.args == ("r", PROMPT, PARAMS)
    assert backend.num_context_fallbacks == 1
    assert asyncio.run(backend.stats())["context_fallbacks"] == 1
    exposed = ServingMetrics().render(asyncio.run(backend.stats())).decode()
    assert "windserve_context_fallbacks_total 1.0" in exposed


def task_error(cause: Exception) -> RayTaskError:
    """What awaiting a call whose replica raised ``cause`` raises."""
    return RayTaskError("prefill", "Traceback ...", cause).as_instanceof_cause()


@pytest.mark.parametrize("error", [PromptTooLongError("the prompt has 9999 tokens"),
                                   task_error(PromptTooLongError("the prompt has 9999 tokens")),
                                   task_error(ActorDiedError())],  # the replica's own error, not its death
                         ids=["ValueError", "RayTaskError(ValueError)", "RayTaskError(ActorDiedError)"])
def test_an_error_of_the_request_is_not_retried(error):
    async def refused(request_id, prompt, params, hint=None):
        raise error

    backend, handles = backend_with(refused)
    with pytest.raises(type(error)):
        asyncio.run(collect(backend))
    assert handles["generation"].calls == [] and backend.num_context_fallbacks == 0


def test_a_cancel_while_prefilling_cancels_the_prefill_call():
    async def forever(request_id, prompt, params, hint=None):
        await asyncio.Event().wait()

    async def run():
        backend, handles = backend_with(forever)
        consumer = asyncio.ensure_future(anext(backend.generate("r", PROMPT, PARAMS)))
        while not handles["context"].calls:
            await asyncio.sleep(0)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        return handles

    handles = asyncio.run(run())
    assert [c.is_cancelled for c in handles["context"].called("prefill")] == [True]
    assert handles["generation"].calls == []


def test_a_consumer_leaving_after_token_0_cancels_the_generation_call():
    async def run():
        backend, handles = backend_with(prefilled)
        updates = backend.generate("r", PROMPT, PARAMS)
        assert await anext(updates) == AGGREGATED[0]
        await updates.aclose()
        return handles

    assert [c.is_cancelled for c in asyncio.run(run())["generation"].called("generate")] == [True]
