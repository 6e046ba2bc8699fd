"""The HTTP client: stream ``/completions`` and time every chunk (TTFT, ITL, latency).

``run_load`` sends a trace at its arrival times with at most ``concurrency``
in flight; ``run_alternating`` sends one request at a time to several
endpoints in turn (order flipped every request), for side-by-side ratios.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from bench.common import progress
from bench.serve.trace import RequestSpec

PROGRESS_EVERY_S = 10.0


@dataclass
class RequestResult:
    index: int
    is_long: bool
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    traces: list[dict] = field(default_factory=list)  # chunks' windserve_trace + "client" (bench.serve_path)
    request_id: str | None = None  # the chunks' ``id``

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


def is_token_chunk(choice: dict) -> bool:
    """A chunk that carries output: text, or (completions) an empty text before the end. A chat
    stream's opening ``{"role": "assistant", "content": ""}`` delta carries none: TTFT starts later."""
    delta = choice.get("delta") or {}
    text = choice.get("text") or delta.get("content")
    if "role" in delta and not text:
        return False
    return bool(text) or choice.get("finish_reason") is None


def request_of(model: str, spec: RequestSpec, chat: bool) -> tuple[str, dict]:
    """(path, body): ``completions`` with the prompt, or ``chat/completions`` with it as one user message."""
    body = {"model": model, "max_tokens": spec.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    body |= spec.extra_body or {}
    if chat:
        return "chat/completions", body | {"messages": [{"role": "user", "content": spec.prompt}]}
    return "completions", body | {"prompt": spec.prompt}


async def send(client: httpx.AsyncClient, model: str, spec: RequestSpec, chat: bool = False) -> RequestResult:
    """Stream one completion (``chat``: a chat completion); the result records the chunk arrival times."""
    result = RequestResult(spec.index, spec.is_long)
    path, body = request_of(model, spec, chat)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[len("data: "):]), time.perf_counter()
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                result.request_id = result.request_id or chunk.get("id")
                if "windserve_trace" in chunk:  # the server's hop times (WINDSERVE_TRACE_PATH=1)
                    result.traces.append({**chunk["windserve_trace"], "client": time.monotonic()})
                if chunk.get("usage"):
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                    details = chunk["usage"].get("prompt_tokens_details") or {}
                    result.num_cached_tokens = details.get("cached_tokens") or 0
                if not any(map(is_token_chunk, chunk.get("choices") or [])):
                    continue  # the usage chunk, or a finish_reason-only chunk after the last token
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        if result.num_output_tokens == 0:  # no usage chunk: one token per chunk
            result.num_output_tokens = len(result.itls_s) + (result.ttft_s is not None)
        result.ok = result.ttft_s is not None and result.num_output_tokens == spec.max_tokens
        if not result.ok:
            result.error = f"{result.num_output_tokens} of {spec.max_tokens} tokens"
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_load(base_url: str, model: str, trace: list[RequestSpec], concurrency: int | None,
                   max_seconds: float, label: str = "", timeout_s: float = 120.0,
                   chat: bool = False, keepalive: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``trace`` at its arrival times, at most ``concurrency`` in flight; (results, wall seconds).

    Requests still unanswered after ``max_seconds`` are cancelled and count as failed. ``keepalive=False``:
    a new connection per request. llama-server (cpp-httplib) closes a connection after 5 requests, and a
    request sent on it as it closes fails with "server disconnected" (1-3 of 16 in the 2026-12-05 runs before c2e733e).
    """
    limit = asyncio.Semaphore(concurrency or len(trace))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=(concurrency or len(trace)) + 4,
                          max_keepalive_connections=None if keepalive else 0)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - start)))
            async with limit:
                results.append(await send(client, model, spec, chat))

        tasks = [asyncio.create_task(one(spec)) for spec in trace]
        reporter = asyncio.create_task(_report_progress(label, results, len(trace), start))
        _, pending = await asyncio.wait(tasks, timeout=max_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        reporter.cancel()
        elapsed = time.perf_counter() - start
    answered = {r.index for r in results}
    results += [RequestResult(s.index, s.is_long, error=f"not finished within {max_seconds:.0f}s")
                for s in trace if s.index not in answered]
    return sorted(results, key=lambda r: r.index), elapsed


async def _report_progress(label: str, results: list[RequestResult], total: int, start: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        failed = sum(not r.ok for r in results)
        progress(f"{label} {len(results)}/{total} done, {failed} failed, {time.perf_counter() - start:.0f}s")


async def run_alternating(urls: dict[str, str], model: str, trace: list[RequestSpec],
                          max_seconds: float) -> dict[str, tuple[list[RequestResult], float]]:
    """One request at a time, each spec sent to every mode in turn (order flipped every spec)."""
    modes, results = list(urls), {mode: [] for mode in urls}
    clients = {mode: httpx.AsyncClient(base_url=url.rstrip("/") + "/", timeout=max_seconds)
               for mode, url in urls.items()}
    deadline = time.perf_counter() + max_seconds
    try:
        for spec in trace:
            for mode in (modes if spec.index % 2 == 0 else modes[::-1]):
                results[mode].append(await send(clients[mode], model, spec) if time.perf_counter() < deadline else
                                     RequestResult(spec.index, spec.is_long, error="past --max-seconds"))
    finally:
        for client in clients.values():
            await client.aclose()
    return {mode: (rs, sum(r.latency_s or 0.0 for r in rs)) for mode, rs in results.items()}
