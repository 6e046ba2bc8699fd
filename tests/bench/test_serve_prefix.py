"""bench.serve's shared-prefix workload: the chat trace, and a --quick run against two fake endpoints.

The fake with ``tokens_per_block`` plays a prefix cache (tests.app.fakes), so the
run's figures come from the same usage fields and /metrics series as on Serve.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from app.api import build_api
from bench import serve as bench_serve
from bench.serve.prefix import SIZES
from bench.serve.trace import make_chat_trace
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer, cached_prefix_len

BLOCK = 16


@pytest.fixture(scope="module")
def urls():
    on = LiveServer(build_api(FakeBackend(token_delay_s=0.001, tokens_per_block=BLOCK), ByteTokenizer())).start()
    off = LiveServer(build_api(FakeBackend(token_delay_s=0.001), ByteTokenizer())).start()
    yield {"on": f"{on.url}/v1", "off": f"{off.url}/v1"}
    on.stop()
    off.stop()


def test_chat_trace_turns_extend_the_previous_prompt():
    trace = make_chat_trace(4, 3, system_len=100, question_len=10, answer_len=6, seed=1)
    assert trace == make_chat_trace(4, 3, system_len=100, question_len=10, answer_len=6, seed=1)
    assert [s.index for s in trace] == list(range(12)) and [s.turn for s in trace] == [0] * 4 + [1] * 4 + [2] * 4
    by_conversation = [trace[c::4] for c in range(4)]
    for turns in by_conversation:
        for previous, spec in zip(turns, turns[1:]):
            grown = spec.prompt[len(previous.prompt):]  # " " + answer (6 tokens) + "\nuser: " + Q + "\nassistant:"
            assert spec.prompt.startswith(previous.prompt) and grown.startswith(" ") and len(grown) == 6 + 7 + 10 + 11
    systems = [turns[0].prompt[:100] for turns in by_conversation]
    assert systems[0] == systems[1] == systems[2] != systems[3]  # every 4th conversation has its own
    assert all(s.max_tokens == 6 for s in trace)


def test_quick_run_reports_cache_on_vs_off(urls, tmp_path):
    argv = ["--workload", "shared-prefix", "--quick", "--base-url", urls["on"], "--off-url", urls["off"],
            "--model", MODEL, "--max-seconds", "30", "--out", str(tmp_path)]
    figures = bench_serve.main(argv)
    on, off = figures["modes"]["on"], figures["modes"]["off"]
    trace = make_chat_trace(**SIZES["quick"], seed=0)
    assert on["num_failed"] == off["num_failed"] == 0, (on["errors"], off["errors"])
    prompts = [list(spec.prompt.encode()) for spec in trace]
    hits = [cached_prefix_len(p, prompts[:i], BLOCK) for i, p in enumerate(prompts)]
    assert hits[0] == 0 and all(h > 0 for h in hits[1:])  # conversation 1 shares the system prompt
    queried = sum(map(len, prompts))
    assert on["hit_rate"] == {"context": sum(hits) / queried} and off["hit_rate"] == {}
    assert on["cached_prompt_fraction"] == sum(hits) / queried and off["cached_prompt_fraction"] == 0
    assert on["kv_bytes_per_request"] is off["kv_bytes_per_request"] is None  # no generation worker reports bytes
    with open(os.path.join(tmp_path, "serve_prefix.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert record["name"] == "serve_prefix" and record["sizes"] == SIZES["quick"]
    assert [r["num_cached_tokens"] for r in record["requests"]["on"]] == hits
    assert [r["num_prompt_tokens"] for r in record["requests"]["off"]] == list(map(len, prompts))
    if importlib.util.find_spec("matplotlib") is not None:  # the plot needs the bench extra
        assert os.path.getsize(os.path.join(tmp_path, "serve_prefix.png")) > 0
