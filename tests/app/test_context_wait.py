"""A bounded wait for a dead context replica (app.serve_backend): once a context call failed as
unavailable, a request no context replica accepts falls back to a local prefill within
CONTEXT_WAIT_BOUND_S; with no failure seen it waits for a replica as Serve does. Fake handles, no Ray."""

from __future__ import annotations

import asyncio
import time

from ray.exceptions import ActorDiedError

import app.serve_backend as serve_backend
from tests.app.test_serve_backend import AGGREGATED, PARAMS, PROMPT, backend_with, update


async def prefill_or_die(request_id, prompt, params, hint=None):
    """The one replica dies under the first request (0.3 s in); the rest never reach a replica."""
    await asyncio.sleep(0.3)
    raise ActorDiedError()


async def consume(backend, request_id: str) -> tuple[list, float]:
    started = time.monotonic()
    updates = [u async for u in backend.generate(request_id, PROMPT, PARAMS)]
    return updates, time.monotonic() - started


def test_a_request_no_replica_accepts_falls_back_within_the_bound_after_a_failure():
    """r-dead was inside the killed replica (its call fails: fallback at once). r-queued was sent
    before the failure and no replica accepts it (Serve would wait for the replacement): it falls
    back CONTEXT_WAIT_BOUND_S (2 s) after the failure, give or take one CONTEXT_POLL_S and a loaded
    machine's scheduling (0.5 s), not when a replacement comes."""
    async def run():
        backend, handles = backend_with(prefill_or_die)
        handles["context"].max_accepted = 1
        dead = asyncio.ensure_future(consume(backend, "r-dead"))
        while not handles["context"].calls:
            await asyncio.sleep(0)
        queued = asyncio.ensure_future(consume(backend, "r-queued"))  # waits for a replica before the failure
        dead = await dead
        failed_at = backend.context_failed_at
        result = await queued
        return backend, handles, dead, result, time.monotonic() - failed_at

    backend, handles, dead, (queued_updates, _), since_failure = asyncio.run(run())
    bound = serve_backend.CONTEXT_WAIT_BOUND_S
    assert dead[0] == AGGREGATED and queued_updates == AGGREGATED  # both served whole, locally
    assert bound <= since_failure <= bound + serve_backend.CONTEXT_POLL_S + 0.5
    assert backend.paths == {"r-queued": "fell back: wait bound", "r-dead": "fell back: unavailable"}
    assert [(c.args[0], c.is_cancelled) for c in handles["context"].called("prefill")] == [
        ("r-dead", False), ("r-queued", True)]  # the queued call is withdrawn from Serve's queue
    assert sorted(c.args[0] for c in handles["generation"].called("generate_local")) == ["r-dead", "r-queued"]
    assert backend.num_context_fallbacks == 2


def test_with_no_failure_seen_an_unaccepted_request_waits_for_a_replica(monkeypatch):
    """No context call failed: a full deployment is backpressure, not a death, so the request waits
    (here 3x the bound) and is prefilled by the context replica that accepts it."""
    monkeypatch.setattr(serve_backend, "CONTEXT_WAIT_BOUND_S", 0.2)

    async def prefill(request_id, prompt, params, hint=None):
        from actors.messages import Prefilled
        from tests.app.test_serve_backend import KV
        return Prefilled(update(10, "a"), KV)

    async def run():
        backend, handles = backend_with(prefill)
        handles["context"].max_accepted = 0
        consumer = asyncio.ensure_future(consume(backend, "r"))
        await asyncio.sleep(0.6)
        assert not consumer.done()
        handles["context"].accept_waiting()
        return backend, handles, await consumer

    backend, handles, (updates, _) = asyncio.run(run())
    assert "".join(u.new_text for u in updates) == "abc"
    assert backend.paths == {"r": "context"} and backend.num_context_fallbacks == 0
    assert [c.method for c in handles["generation"].calls] == ["generate"]
    assert [c.is_cancelled for c in handles["context"].called("prefill")] == [False]
