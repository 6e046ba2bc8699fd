"""bench.serve's client against the app's HTTP layer over a fake backend (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal

import pytest
import torch

from app.api import build_api
from bench import serve as bench_serve
from bench.serve.client import run_load
from bench.serve.stats import summarize
from bench.serve.trace import RequestSpec, make_trace
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer

NUM_REQUESTS = 6


@pytest.fixture(scope="module")
def base_url():
    live = LiveServer(build_api(FakeBackend(token_delay_s=0.002), ByteTokenizer())).start()
    yield f"{live.url}/v1"
    live.stop()


def test_same_seed_same_trace():
    first = make_trace(20, 32, 8, seed=3, rate=5.0, mix="long-short", long_input_len=200,
                                   long_fraction=0.3)
    assert first == make_trace(20, 32, 8, seed=3, rate=5.0, mix="long-short", long_input_len=200,
                                           long_fraction=0.3)
    assert any(spec.is_long for spec in first) and not first[0].is_long
    assert all(len(s.prompt) >= 150 if s.is_long else 24 <= len(s.prompt) <= 40 for s in first)
    assert [s.arrival_s for s in first] == sorted(s.arrival_s for s in first)


def test_bench_endpoint_writes_figures(base_url, tmp_path):
    argv = ["--base-url", base_url, "--model", MODEL, "--num-requests", str(NUM_REQUESTS), "--concurrency", "3",
            "--input-len", "24", "--output-len", "10", "--mix", "long-short", "--long-input-len", "120",
            "--long-fraction", "0.4", "--rate", "50", "--max-seconds", "20", "--out", str(tmp_path)]
    summary = bench_serve.main(argv)
    with open(os.path.join(tmp_path, "serve.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert record["name"] == "serve" and record["summary"] == json.loads(json.dumps(summary))
    assert summary["num_requests"] == NUM_REQUESTS and summary["num_failed"] == 0, summary["errors"]
    assert summary["request_throughput"] > 0 and summary["output_throughput"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        assert 0 < summary[metric]["p50"] <= summary[metric]["p90"] <= summary[metric]["p99"]
    requests = record["requests"]
    assert [r["index"] for r in requests] == list(range(NUM_REQUESTS))
    for r, spec in zip(requests, make_trace(NUM_REQUESTS, 24, 10, seed=0, rate=50, mix="long-short",
                                                       long_input_len=120, long_fraction=0.4)):
        assert r["ok"] and r["error"] is None
        assert 0 < r["ttft_s"] <= r["latency_s"]
        assert r["num_output_tokens"] == spec.max_tokens == len(r["itls_s"]) + 1  # one token per chunk here
        assert r["num_prompt_tokens"] == len(spec.prompt)  # one byte, one token


def process_state() -> dict:
    """What a library call must leave as it found it: signal handlers, the interval timer, the
    environment, torch's thread count."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGUSR1, signal.SIGHUP)
    return {"signals": {sig: signal.getsignal(sig) for sig in signals}, "itimer": signal.getitimer(signal.ITIMER_REAL),
            "environ": dict(os.environ), "torch_threads": torch.get_num_threads()}


def test_main_leaves_no_timer_armed(base_url, tmp_path, monkeypatch):
    """main() once armed faulthandler.dump_traceback_later(..., exit=True) and never cancelled it: the
    process that called it (pytest, a notebook) was killed ~140 s after main() returned (issue 17)."""
    armed = []  # faulthandler cannot be asked whether a dump is pending, so record arm / cancel calls
    monkeypatch.setattr(faulthandler, "dump_traceback_later", lambda *args, **kwargs: armed.append(args))
    monkeypatch.setattr(faulthandler, "cancel_dump_traceback_later", armed.clear)
    before = process_state()
    argv = ["--base-url", base_url, "--model", MODEL, "--num-requests", "2", "--concurrency", "2",
            "--input-len", "8", "--output-len", "2", "--max-seconds", "20", "--out", str(tmp_path)]
    summary = bench_serve.main(argv)
    assert summary["num_failed"] == 0, summary["errors"]
    assert armed == [], f"main() returned with a faulthandler dump armed: {armed}"
    assert process_state() == before


def test_failed_requests_are_counted(base_url):
    trace = [RequestSpec(0, 0.0, "Hi", 4)]
    results, _ = asyncio.run(run_load(base_url, "no-such-model", trace, 1, max_seconds=10))
    assert not results[0].ok and "HTTP 404" in results[0].error
    summary = summarize(results, 1.0)
    assert summary["num_failed"] == 1 and summary["ttft_ms"]["p50"] is None


def test_requests_past_the_time_bound_fail(base_url):
    trace = [RequestSpec(0, 0.0, "Hi", 200), RequestSpec(1, 5.0, "Hi", 4)]
    results, elapsed = asyncio.run(run_load(base_url, MODEL, trace, 2, max_seconds=0.2))
    assert elapsed < 2 and [r.ok for r in results] == [False, False]
    assert all("not finished within" in r.error for r in results)
