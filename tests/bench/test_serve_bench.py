"""bench.serve's client against the app's HTTP layer over a fake backend (uvicorn on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from app.api import build_api
from bench import serve as bench_serve
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer

NUM_REQUESTS = 6


@pytest.fixture(scope="module")
def base_url():
    live = LiveServer(build_api(FakeBackend(token_delay_s=0.002), ByteTokenizer())).start()
    yield f"{live.url}/v1"
    live.stop()


def test_same_seed_same_trace():
    first = bench_serve.make_trace(20, 32, 8, seed=3, rate=5.0, mix="long-short", long_input_len=200,
                                   long_fraction=0.3)
    assert first == bench_serve.make_trace(20, 32, 8, seed=3, rate=5.0, mix="long-short", long_input_len=200,
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
    for r, spec in zip(requests, bench_serve.make_trace(NUM_REQUESTS, 24, 10, seed=0, rate=50, mix="long-short",
                                                       long_input_len=120, long_fraction=0.4)):
        assert r["ok"] and r["error"] is None
        assert 0 < r["ttft_s"] <= r["latency_s"]
        assert r["num_output_tokens"] == spec.max_tokens == len(r["itls_s"]) + 1  # one token per chunk here
        assert r["num_prompt_tokens"] == len(spec.prompt)  # one byte, one token


def test_failed_requests_are_counted(base_url):
    trace = [bench_serve.RequestSpec(0, 0.0, "Hi", 4)]
    results, _ = asyncio.run(bench_serve.run_load(base_url, "no-such-model", trace, 1, max_seconds=10))
    assert not results[0].ok and "HTTP 404" in results[0].error
    summary = bench_serve.summarize(results, 1.0)
    assert summary["num_failed"] == 1 and summary["ttft_ms"]["p50"] is None


def test_requests_past_the_time_bound_fail(base_url):
    trace = [bench_serve.RequestSpec(0, 0.0, "Hi", 200), bench_serve.RequestSpec(1, 5.0, "Hi", 4)]
    results, elapsed = asyncio.run(bench_serve.run_load(base_url, MODEL, trace, 2, max_seconds=0.2))
    assert elapsed < 2 and [r.ok for r in results] == [False, False]
    assert all("not finished within" in r.error for r in results)
