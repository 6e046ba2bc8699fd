"""The command line of ``python -m bench.serve`` (see bench.serve) and one endpoint's run."""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import asdict

from bench.common import print_table, progress, write_json, write_plot
from bench.serve.client import run_load
from bench.serve.compare import compare
from bench.serve.local_prefill import local_prefill
from bench.serve.prefix import shared_prefix
from bench.serve.repeat_prefix import repeat_prefix
from bench.serve.routing import routing_compare
from bench.serve.stats import draw, summarize, summary_rows
from bench.serve.trace import RequestSpec, make_trace

DESCRIPTION = "Serving latency and throughput against any OpenAI-compatible endpoint (like vllm bench serve)."


def trace_from_args(args: argparse.Namespace) -> list[RequestSpec]:
    return make_trace(args.num_requests, args.input_len, args.output_len, args.spread, seed=args.seed,
                      rate=args.rate, mix=args.mix, long_input_len=args.long_input_len,
                      long_fraction=args.long_fraction)


def bench_endpoint(args: argparse.Namespace) -> dict:
    trace = trace_from_args(args)
    progress(f"{len(trace)} requests to {args.base_url} ({args.model}), "
             f"{f'rate {args.rate:.2f}/s' if args.rate else 'all at once'}, concurrency {args.concurrency}")
    results, elapsed = asyncio.run(run_load(args.base_url, args.model, trace, args.concurrency, args.max_seconds))
    summary = summarize(results, elapsed)
    settings = {k: v for k, v in vars(args).items() if k not in ("compare", "out")}
    path = write_json(args.out, "serve", {"settings": settings, "summary": summary,
                                          "requests": [asdict(r) for r in results]})
    write_plot(args.out, "serve", lambda plt: draw(plt, {args.model: results}))
    print_table("latency (ms)", ["run", "metric", "p50", "p90", "p99"], summary_rows(args.model, summary))
    print_table("throughput", ["requests", "failed", "req/s", "output tok/s"],
                [[summary["num_requests"], summary["num_failed"], summary["request_throughput"],
                  summary["output_throughput"]]])
    progress(f"wrote {path}")
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve", description=DESCRIPTION)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="windserve-tiny")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s (default: all at once)")
    parser.add_argument("--concurrency", type=int, default=8, help="most requests in flight")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--spread", type=float, default=0.25, help="lengths uniform in len*(1 +- spread)")
    parser.add_argument("--mix", choices=("none", "long-short"), default="none")
    parser.add_argument("--long-input-len", type=int, default=1500)
    parser.add_argument("--long-fraction", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="bound of one load run")
    parser.add_argument("--compare", action="store_true", help="serve disagg.yaml then aggregated.yaml, same traces")
    parser.add_argument("--quick", action="store_true",
                        help="--compare or --workload shared-prefix with the smallest sizes (~2 min)")
    parser.add_argument("--in-turn", action="store_true",
                        help="--compare: serve one config at a time (default: both at once, requests alternating)")
    parser.add_argument("--port", type=int, default=None, help="--compare: port instead of the configs' own")
    parser.add_argument("--workload", choices=("random", "shared-prefix", "local-prefill", "repeat-prefix"),
                        default="random",
                        help="shared-prefix: multi-turn chats, prefix cache on vs off (bench.serve.prefix); "
                             "repeat-prefix: system prompts asked several questions each, the fraction of "
                             "repeats the router keeps cached (bench.serve.repeat_prefix); "
                             "local-prefill: TTFT of local prefill vs the context hop (bench.serve.local_prefill)")
    parser.add_argument("--config", default=os.path.join("configs", "disagg.yaml"),
                        help="--workload shared-prefix: the config served twice, cache on and off")
    parser.add_argument("--off-url", default=None,
                        help="--workload shared-prefix: measure --base-url (cache on) and this endpoint (off) "
                             "instead of serving --config")
    parser.add_argument("--context-replicas", type=int, default=1,
                        help="--workload shared-prefix: with 2 or more, KV-aware vs Serve's default router "
                             "(bench.serve.routing) instead of cache on vs off")
    parser.add_argument("--generation-replicas", type=int, default=1, help="with --context-replicas")
    parser.add_argument("--turns", type=int, default=None,
                        help="--context-replicas: turns per conversation (default: the size's); a first turn "
                             "always misses, so more turns raise the hit rate any router can reach")
    parser.add_argument("--conversations", type=int, default=None,
                        help="--context-replicas: conversations in the trace (default: the size's)")
    parser.add_argument("--num-pages", type=int, default=None,
                        help="--context-replicas: every worker's KV pages (the config's num_pages); smaller than "
                             "all conversations' prefixes puts the caches under pressure")
    parser.add_argument("--runs", type=int, default=3, help="--workload repeat-prefix: fresh apps per pattern")
    parser.add_argument("--routers", default="kv", help="--workload repeat-prefix: kv, default or kv,default")
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark that ``argv`` asks for and return its figures.

    A library call: it arms no timer and leaves no signal handler or setting
    behind (``python -m bench.serve`` adds its watchdog in ``__main__``).
    """
    args = parse_args(argv)
    if args.workload == "shared-prefix":
        return routing_compare(args) if args.context_replicas > 1 else shared_prefix(args)
    if args.workload == "repeat-prefix":
        return repeat_prefix(args)
    if args.workload == "local-prefill":
        return local_prefill(args)
    return compare(args) if args.compare else bench_endpoint(args)


def watchdog_s(args: argparse.Namespace) -> float:
    """How long ``python -m bench.serve`` may run before it dumps every thread's stack and exits."""
    if args.workload == "repeat-prefix":  # per router: startup (minutes on a loaded machine), then every run
        return len(args.routers.split(",")) * (900.0 + 2 * args.runs * args.max_seconds)
    if args.compare or args.workload != "random":  # startup, warm-up and the run: --max-seconds bounds the run
        return max(900.0, args.max_seconds + 300.0)
    return args.max_seconds + 120.0
