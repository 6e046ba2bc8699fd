"""bench.serve.routing without Serve: the options each mode is served with, and its figures."""

from __future__ import annotations

from ray.serve.config import RequestRouterConfig

from bench.serve.cli import parse_args, watchdog_s
from bench.serve.client import RequestResult
from bench.serve.routing import app_overrides, routing_figures, worker_options


def result(index: int, ttft_s: float) -> RequestResult:
    return RequestResult(index=index, is_long=False, ok=True, ttft_s=ttft_s, num_prompt_tokens=100)


def test_the_default_mode_gets_serves_own_router_and_both_the_same_replicas():
    args = parse_args(["--workload", "shared-prefix", "--context-replicas", "2", "--generation-replicas", "3"])
    kv, default = worker_options(args, "kv"), worker_options(args, "default")
    assert {n: o["num_replicas"] for n, o in kv.items()} == {"ContextWorker": 2, "GenerationWorker": 3}
    assert all("request_router_config" not in o for o in kv.values())  # build_app's: app.routing's router
    assert all(o["request_router_config"] == RequestRouterConfig() for o in default.values())
    assert {n: o["num_replicas"] for n, o in default.items()} == {n: o["num_replicas"] for n, o in kv.items()}


def test_figures_compare_the_context_hit_rates_and_ttft():
    deltas = {"kv": {"context": {"prefix_cache_queries": 1000.0, "prefix_cache_hits": 850.0, "kv_transfer_bytes": 0}},
              "default": {"context": {"prefix_cache_queries": 1000.0, "prefix_cache_hits": 400.0,
                                      "kv_transfer_bytes": 0}}}
    runs = {"kv": ([result(0, 0.1), result(1, 0.1)], deltas["kv"]),
            "default": ([result(0, 0.2), result(1, 0.2)], deltas["default"])}
    figures = routing_figures(runs)
    assert figures["hit_rate_kv"] == 0.85
    assert abs(figures["hit_rate_kv_over_default"] - 0.85 / 0.4) < 1e-9
    assert abs(figures["ttft_p50_default_over_kv"] - 2.0) < 1e-9


def test_cache_pressure_sets_every_workers_pages_in_both_modes():
    args = parse_args(["--workload", "shared-prefix", "--context-replicas", "3", "--num-pages", "160",
                       "--conversations", "9"])
    assert app_overrides(args) == {m: {"local_prefill_max_tokens": 0, "num_pages": 160} for m in ("kv", "default")}
    assert args.conversations == 9
    plain = app_overrides(parse_args(["--workload", "shared-prefix", "--context-replicas", "3"]))
    assert plain == {m: {"local_prefill_max_tokens": 0} for m in ("kv", "default")}


def test_the_watchdog_outlasts_a_long_run():
    assert watchdog_s(parse_args(["--workload", "shared-prefix", "--context-replicas", "3"])) == 900.0
    long = parse_args(["--workload", "shared-prefix", "--context-replicas", "3", "--max-seconds", "1800"])
    assert watchdog_s(long) == 2100.0
