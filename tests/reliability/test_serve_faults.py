"""Worker replicas killed under live requests: bounded, clear errors; Serve replaces
the replica; no page stays held (the context side's leases lapse).

    kill GenerationWorker mid-stream  -> error event + [DONE] on the stream, later requests succeed
    kill ContextWorker during prefill -> each request completes or fails clearly; none hangs

Actor-level faults (dead peer before transfer, bad transfer) are in tests/actors/test_faults.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.reliability.conftest import (
    LEASE_S,
    MAX_QUEUE,
    Service,
    completes,
    completion_body,
    kill_replica,
    pages_in_use,
    record,
    replica_actors,
    wait_pages_free,
    wait_serving,
    wait_until,
    worker_stats,
)

MAX_TIME_TO_ERROR_S = 30.0
RECOVERY_S = 90.0
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 7  # 308 tokens: 5 prefill chunks of 64


def data_events(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def error_of(payload: str) -> dict | None:
    if payload == "[DONE]":
        return None
    return json.loads(payload).get("error")


def recover(service: Service, deployment: str, killed: str) -> float:
    """Seconds until a new replica of ``deployment`` serves a request."""
    start = time.monotonic()
    assert wait_until(lambda: killed not in {a.name for a in replica_actors(deployment)} and completes(service),
                      RECOVERY_S, 0.5), f"no request succeeded within {RECOVERY_S}s of killing {killed}"
    return time.monotonic() - start


def test_generation_replica_killed_mid_stream(service: Service):
    assert wait_serving(service)
    body = completion_body("Hi", max_tokens=340, stream=True)
    with service.client(timeout_s=MAX_TIME_TO_ERROR_S) as http, \
            http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        head = [next(lines) for _ in range(6)]  # events and their blank separators: the stream is decoding
        assert all(not error_of(p) for p in data_events(head))
        victim = kill_replica("GenerationWorker")
        start = time.monotonic()
        rest = list(lines)  # a hang would end in httpx.ReadTimeout after MAX_TIME_TO_ERROR_S
        time_to_error = time.monotonic() - start
    events = data_events(rest)
    assert events[-1] == "[DONE]"
    errors = [e for e in map(error_of, events) if e]
    assert len(errors) == 1 and errors[0]["type"] == "server_error", events[-3:]
    assert set(errors[0]) == {"message", "type", "param", "code"}
    assert time_to_error < MAX_TIME_TO_ERROR_S

    recovery_s = recover(service, "GenerationWorker", victim.name)
    # The killed replica's pages died with it; the context side must hold none either.
    free_s = wait_pages_free(service, timeout_s=LEASE_S + 15)
    assert free_s is not None, pages_in_use(service)
    record("kill_generation_mid_stream", time_to_error_s=round(time_to_error, 2),
           recovery_s=round(recovery_s, 1), pages_free_after_s=round(free_s, 1))


async def run_one(http: httpx.AsyncClient, body: dict) -> tuple[str, float]:
    """("ok" | "error" | "hang" | "bad:<why>", seconds) of one request."""
    start = time.monotonic()
    try:
        if body.get("stream"):
            async with http.stream("POST", "/v1/completions", json=body) as reply:
                raw = (await reply.aread()).decode()
            if reply.status_code != 200:
                return classify_status(reply.status_code, raw), time.monotonic() - start
            events = data_events(raw.split("\n"))
            errors = [e for e in map(error_of, events) if e]
            outcome = "error" if errors and errors[0].get("type") == "server_error" else "ok"
            if events[-1:] != ["[DONE]"]:
                outcome = "bad:no [DONE]"
        else:
            reply = await http.post("/v1/completions", json=body)
            outcome = "ok" if reply.status_code == 200 else classify_status(reply.status_code, reply.text)
    except httpx.TimeoutException:
        outcome = "hang"
    return outcome, time.monotonic() - start


def classify_status(status: int, text: str) -> str:
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return f"bad:{status} not in OpenAI's shape"
    if status >= 500 and set(error) == {"message", "type", "param", "code"}:
        return "error"
    return f"bad:{status}"


async def kill_context_during_prefill(service: Service, num_requests: int) -> tuple[list[tuple[str, float]], str, dict]:
    bodies = [completion_body(LONG_PROMPT + str(i), max_tokens=16, stream=i % 2 == 0) for i in range(num_requests)]
    async with service.async_client(timeout_s=MAX_TIME_TO_ERROR_S + 30) as http:
        tasks = [asyncio.create_task(run_one(http, body)) for body in bodies]

        def prefilling() -> dict | None:
            stats = worker_stats("ContextWorker")
            return stats if stats["num_running"] + stats["num_waiting"] > 0 else None

        seen = None
        for _ in range(200):  # 10 s at most
            seen = await asyncio.to_thread(prefilling)
            if seen or all(t.done() for t in tasks):
                break
            await asyncio.sleep(0.05)
        assert seen, "no prefill was ever seen in progress"
        victim = await asyncio.to_thread(kill_replica, "ContextWorker")
        outcomes = await asyncio.gather(*tasks)
    return outcomes, victim.name, seen


def test_context_replica_killed_during_prefill(service: Service):
    assert wait_serving(service)
    outcomes, victim, seen = asyncio.run(kill_context_during_prefill(service, MAX_QUEUE - 4))
    kinds = [kind for kind, _ in outcomes]
    assert not [k for k in kinds if k == "hang" or k.startswith("bad")], kinds
    assert "error" in kinds, f"the kill hit no request: {kinds}"
    max_s = max(seconds for _, seconds in outcomes)
    assert max_s < MAX_TIME_TO_ERROR_S + 30

    recovery_s = recover(service, "ContextWorker", victim)
    free_s = wait_pages_free(service, timeout_s=LEASE_S + 15)
    assert free_s is not None, pages_in_use(service)
    record("kill_context_during_prefill", requests=len(kinds), ok=kinds.count("ok"),
           failed_clearly=kinds.count("error"),
           lost=0, max_request_s=round(max_s, 2), in_prefill_at_kill=seen["num_running"] + seen["num_waiting"],
           recovery_s=round(recovery_s, 1), pages_free_after_s=round(free_s, 1))


def test_other_requests_are_answered_after_the_faults(service: Service):
    assert wait_serving(service)
    with service.client() as http:
        replies = [http.post("/v1/completions", json=completion_body(f"Hello {i}", max_tokens=8)) for i in range(5)]
    assert [r.status_code for r in replies] == [200] * 5
    assert wait_pages_free(service) is not None
