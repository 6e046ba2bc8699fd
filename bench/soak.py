"""A bounded mixed load against a windserve deployment, for soak tests.

    python -m bench.soak --minutes 5        starts its own Ray + Serve on 127.0.0.1 and prints one JSON line

Each of ``concurrency`` client loops draws one kind of request at a time
(seeded) until the deadline or ``max_requests``:

    short       10-token prompt, 8 tokens, whole reply
    long        ~300-token prompt, 16 tokens, whole reply
    stream      streamed completion, 32 tokens, read to [DONE]
    chat        streamed chat completion, 16 tokens
    cancel      streamed, 300 tokens, closed by the client after a few events
    disconnect  whole reply of 300 tokens, the connection dropped after 0.3 s

Every request has a timeout; a timed-out one counts as ``hung``. Intended
cancellations count as ``cancelled``; 5xx and error events as ``failed``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from bench.common import start_ray

MODEL = "windserve-tiny"
KINDS = ("short", "long", "stream", "chat", "cancel", "disconnect")
LONG_PROMPT = "the quick brown fox jumps over the lazy dog " * 7
REQUEST_TIMEOUT_S = 30.0


@dataclass
class SoakResult:
    outcomes: Counter = field(default_factory=Counter)  # "<kind>:<ok|cancelled|rejected|failed|hung>" -> count
    max_latency_s: float = 0.0
    seconds: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(self.outcomes.values())

    def count(self, outcome: str) -> int:
        return sum(n for key, n in self.outcomes.items() if key.endswith(f":{outcome}"))


def body_of(kind: str, i: int) -> dict:
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    if kind == "chat":
        messages = [{"role": "user", "content": f"Say something {i}"}]
        return {**base, "messages": messages, "max_tokens": 16, "stream": True}
    prompt = LONG_PROMPT if kind == "long" else f"Request number {i}"
    max_tokens = {"short": 8, "long": 16, "stream": 32}.get(kind, 300)
    return {**base, "prompt": prompt, "max_tokens": max_tokens, "stream": kind in ("stream", "cancel")}


async def one(http: httpx.AsyncClient, kind: str, i: int) -> str:
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    body = body_of(kind, i)
    if kind == "disconnect":
        try:
            await asyncio.wait_for(http.post(path, json=body), 0.3)
        except asyncio.TimeoutError:
            return "cancelled"
        return "ok"
    if not body["stream"]:
        reply = await http.post(path, json=body)
        return status_outcome(reply.status_code)
    async with http.stream("POST", path, json=body) as reply:
        if reply.status_code != 200:
            return status_outcome(reply.status_code)
        num_events = 0
        async for line in reply.aiter_lines():
            if '"error"' in line:
                return "failed"
            num_events += line.startswith("data: ")
            if kind == "cancel" and num_events >= 3:
                return "cancelled"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return "ok"
    return "failed"


def status_outcome(status: int) -> str:
    return "ok" if status == 200 else "rejected" if status == 503 else "failed"


async def client_loop(http: httpx.AsyncClient, rng: random.Random, deadline: float, budget: list[int],
                      result: SoakResult) -> None:
    while time.monotonic() < deadline and budget[0] > 0:
        budget[0] -= 1
        kind = rng.choice(KINDS)
        start = time.monotonic()
        try:
            outcome = await asyncio.wait_for(one(http, kind, budget[0]), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            outcome = "hung"
        except httpx.HTTPError:
            outcome = "failed"
        result.max_latency_s = max(result.max_latency_s, time.monotonic() - start)
        result.outcomes[f"{kind}:{outcome}"] += 1


async def soak(url: str, api_key: str | None, seconds: float, *, concurrency: int = 6, max_requests: int = 100_000,
               seed: int = 0) -> SoakResult:
    """Run the mixed load for ``seconds`` (or ``max_requests``) against ``url`` (the app's root)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result, budget, start = SoakResult(), [max_requests], time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as http:
        loops = [client_loop(http, random.Random(seed * 1000 + k), start + seconds, budget, result)
                 for k in range(concurrency)]
        await asyncio.gather(*loops)
    result.seconds = time.monotonic() - start
    return result


def rss_kib(pid: int) -> int:
    """Resident memory of a local process, from /proc (psutil is not installed)."""
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1])


def worker_pids(app_name: str) -> dict[str, int]:
    """Pids of an app's worker replicas (GCS actor table; the state API needs the dashboard)."""
    from ray._private.state import actors

    prefixes = tuple(f"SERVE_REPLICA::{app_name}#{d}#" for d in ("ContextWorker", "GenerationWorker"))
    return {a["Name"]: a["Pid"] for a in actors().values() if a["State"] == "ALIVE" and a["Name"].startswith(prefixes)}


def pages_in_use(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.labels["worker"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "windserve_kv_pages_in_use"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=6)
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    from app.serve_app import build_app, start_serve

    config = {"mode": "disagg", "tokens_per_block": 8, "num_pages": 48, "max_num_seqs": 8,
              "max_num_batched_tokens": 64, "device": "cpu", "lease_s": 3.0, "max_queue": 16}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/soak"
    start_ray(address="local", num_cpus=2)  # a new instance, never a cluster someone else started
    try:
        start_serve(port)
        serve.run(build_app(config), name="soak", route_prefix="/soak")
        asyncio.run(soak(url, None, 10, concurrency=args.concurrency))  # warm-up
        rss_before = {name: rss_kib(pid) for name, pid in worker_pids("soak").items()}
        result = asyncio.run(soak(url, None, args.minutes * 60, concurrency=args.concurrency, seed=1))
        time.sleep(5)  # leases of cut-off requests lapse (3 s)
        rss_after = {name: rss_kib(pid) for name, pid in worker_pids("soak").items()}
        print(json.dumps({"requests": result.num_requests, "outcomes": dict(result.outcomes),
                          "max_latency_s": round(result.max_latency_s, 2), "pages_in_use": pages_in_use(url),
                          "rss_kib_before": rss_before, "rss_kib_after": rss_after}, sort_keys=True))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
