"""Streamed completions with known lengths, for the planner's served runs (bench.planner_served,
bench.planner_fidelity): each request's id, TTFT, TPOT and tokens as the client saw them.

Prompts are lists of token ids (the completions API takes them), fresh random ones per request, so
their lengths are exact and no two share a cached prefix. Every request asks for exactly
``max_tokens`` (``ignore_eos``) and its usage, so "completed with the right number of tokens" is a
check of the reply, not of the model.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx

MODEL = "windserve-tiny"
REQUEST_TIMEOUT_S = 180.0


@dataclass
class Outcome:
    phase: str
    prompt_len: int
    max_tokens: int
    start_s: float  # time.time() when sent
    end_s: float = 0.0
    first_s: float | None = None  # first token's arrival
    last_s: float | None = None
    request_id: str = ""
    num_chunks: int = 0  # events that carried text
    completion_tokens: int | None = None  # from the usage event
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_complete(self) -> bool:
        """Finished normally with every token asked for."""
        return self.error is None and self.completion_tokens == self.max_tokens and self.finish_reason == "length"

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        if self.first_s is None or self.last_s is None or not self.completion_tokens or self.completion_tokens < 2:
            return None
        return (self.last_s - self.first_s) / (self.completion_tokens - 1)


def prompt_ids(length: int, rng: random.Random) -> list[int]:
    return [rng.randrange(256) for _ in range(length)]


async def complete(http: httpx.AsyncClient, outcome: Outcome, rng: random.Random) -> Outcome:
    """One streamed completion; fills ``outcome``. Never raises (an error is recorded)."""
    body = {"model": MODEL, "prompt": prompt_ids(outcome.prompt_len, rng), "max_tokens": outcome.max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as reply:
            if reply.status_code != 200:
                outcome.error = f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}"
            else:
                async for line in _lines(reply):
                    _take(outcome, line)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:300]
    outcome.end_s = time.time()
    return outcome


async def _lines(reply: httpx.Response):
    """The SSE lines, split on b"\\n" only: httpx's aiter_lines also splits on U+2028, U+0085 and the
    like, which random byte tokens can spell inside an event's JSON text."""
    buffer = b""
    async for chunk in reply.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode().rstrip("\r")
    if buffer:
        yield buffer.decode()


def _take(outcome: Outcome, line: str) -> None:
    if not line.startswith("data: ") or line == "data: [DONE]":
        return
    event = json.loads(line[len("data: "):])
    if "error" in event:
        outcome.error = str(event["error"])[:300]
        return
    outcome.request_id = outcome.request_id or event.get("id", "")
    for choice in event.get("choices") or ():
        if choice.get("text"):
            now = time.time()
            outcome.first_s = outcome.first_s or now
            outcome.last_s = now
            outcome.num_chunks += 1
        outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    if event.get("usage"):
        outcome.completion_tokens = event["usage"]["completion_tokens"]


async def open_loop(http: httpx.AsyncClient, arrivals: list[tuple[float, str, int, int]], max_in_flight: int,
                    seed: int = 0) -> list[Outcome]:
    """Send ``(at_s, phase, prompt_len, max_tokens)`` at their times from now (at most ``max_in_flight``
    at once: a later one waits); every request's outcome."""
    rng, gate, start = random.Random(seed), asyncio.Semaphore(max_in_flight), time.monotonic()

    async def one(at_s: float, phase: str, prompt_len: int, max_tokens: int) -> Outcome:
        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - start)))
        async with gate:
            return await complete(http, Outcome(phase, prompt_len, max_tokens, time.time()), rng)

    return list(await asyncio.gather(*(one(*a) for a in arrivals)))


def poisson_arrivals(rate_per_s: float, duration_s: float, rng: random.Random, offset_s: float = 0.0) -> list[float]:
    times, t = [], rng.expovariate(rate_per_s)
    while t < duration_s:
        times.append(offset_s + t)
        t += rng.expovariate(rate_per_s)
    return times
