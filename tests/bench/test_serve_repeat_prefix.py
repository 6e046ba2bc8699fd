"""bench.serve's repeat-prefix workload (issue 28): its trace, its arrival patterns, and its hit rule,
against fake endpoints that play a prefix cache that never evicts, and no cache at all."""

from __future__ import annotations

import asyncio

import pytest

from app.api import build_api
from bench.serve.repeat_prefix import hit_figures, make_repeat_trace, send_in_pattern
from tests.app.fakes import MODEL, ByteTokenizer, FakeBackend, LiveServer, cached_prefix_len

BLOCK = 16
SIZES = dict(num_prompts=3, num_questions=3, system_len=100, question_len=8, answer_len=2)


@pytest.fixture(scope="module")
def servers():
    cached = FakeBackend(token_delay_s=0.001, tokens_per_block=BLOCK)
    live = {"cached": LiveServer(build_api(cached, ByteTokenizer())).start(),
            "uncached": LiveServer(build_api(FakeBackend(token_delay_s=0.001), ByteTokenizer())).start()}
    yield {name: f"{server.url}/v1" for name, server in live.items()}, cached
    for server in live.values():
        server.stop()


def test_rounds_cycle_over_the_prompts_and_each_system_prompt_is_its_own():
    trace = make_repeat_trace(**SIZES, seed=3)
    assert trace == make_repeat_trace(**SIZES, seed=3) and trace != make_repeat_trace(**SIZES, seed=4)
    assert [s.index for s in trace] == list(range(9)) and [s.turn for s in trace] == [0] * 3 + [1] * 3 + [2] * 3
    systems = [s.prompt[:100] for s in trace]
    assert systems[:3] == systems[3:6] == systems[6:] and len(set(systems[:3])) == 3  # request i asks prompt i % 3
    assert len({s.prompt for s in trace}) == 9  # every question is new
    assert all(s.prompt[100:].startswith("\nuser: ") and len(s.prompt) == 100 + 7 + 8 + 11 for s in trace)


@pytest.mark.parametrize("pattern", ["sequential", "burst"])
def test_every_repeat_hits_a_cache_that_never_evicts(servers, pattern):
    urls, backend = servers
    backend.seen_prompts.clear()
    trace = make_repeat_trace(**SIZES, seed=0)
    results = asyncio.run(send_in_pattern(urls["cached"], MODEL, trace, pattern, max_seconds=30))
    assert [r.index for r in results] == list(range(9)) and all(r.ok for r in results)
    prompts = [list(s.prompt.encode()) for s in trace]
    # round 0: new prefixes (a burst hits nothing among its own, sent at once; sequential may share
    # nothing either: the systems differ from the first character on)
    assert [r.num_cached_tokens for r in results[:3]] == [0, 0, 0]
    expected = [cached_prefix_len(p, prompts[:i], BLOCK) for i, p in enumerate(prompts)][3:]
    assert [r.num_cached_tokens for r in results[3:]] == expected == [96] * 6  # 6 whole blocks of the 100
    figures = hit_figures(trace, results, SIZES["system_len"])
    assert figures == {"num_repeats": 6, "num_hits": 6, "hit_fraction": 1.0, "num_failed": 0,
                       "cached_tokens_of_misses": []}


def test_no_cache_no_hits(servers):
    urls, _ = servers
    trace = make_repeat_trace(**SIZES, seed=0)
    results = asyncio.run(send_in_pattern(urls["uncached"], MODEL, trace, "burst", max_seconds=30))
    assert hit_figures(trace, results, SIZES["system_len"]) == {
        "num_repeats": 6, "num_hits": 0, "hit_fraction": 0.0, "num_failed": 0, "cached_tokens_of_misses": [0] * 6}


def test_a_partial_hit_below_the_fraction_is_a_miss(servers):
    urls, _ = servers
    trace = make_repeat_trace(**SIZES, seed=0)
    results = asyncio.run(send_in_pattern(urls["uncached"], MODEL, trace, "sequential", max_seconds=30))
    results[3].num_cached_tokens, results[4].num_cached_tokens = 80, 79  # 0.8 of 100 exactly, and one short
    figures = hit_figures(trace, results, SIZES["system_len"])
    assert (figures["num_hits"], figures["cached_tokens_of_misses"]) == (1, [79, 0, 0, 0, 0])
