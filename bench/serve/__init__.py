"""Serving latency and throughput against any OpenAI-compatible endpoint (like ``vllm bench serve``).

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 --model windserve-tiny [--rate R | --concurrency C]
    python -m bench.serve --compare [--quick]     # configs/disagg.yaml, then configs/aggregated.yaml
    python -m bench.serve --workload shared-prefix [--quick] [--config configs/disagg.yaml]
    python -m bench.serve --workload shared-prefix --context-replicas 2 [--quick]   # KV-aware vs default router

A trace is a seeded list of requests (arrival time, prompt, exact output
length via ``max_tokens`` + ``ignore_eos``). Every request streams
``/completions``; per request: TTFT, the gaps between streamed chunks (ITL),
time per output token after the first (TPOT), success or the error.

    arrivals   --rate R: Poisson, exponential gaps of mean 1/R (with --concurrency C as a cap)
               no --rate: all at once, at most --concurrency C in flight
    lengths    uniform in [len * (1 - spread), len * (1 + spread)]
    --mix long-short: mostly short prompts; a --long-fraction of them --long-input-len long,
               arriving among the short requests' running decodes

``--compare`` serves configs/disagg.yaml and configs/aggregated.yaml in this
process and sends the same seeded traces to both, side by side (bench.serve.compare).
``--workload shared-prefix`` serves one config twice, prefix cache on and off, and
alternates seeded multi-turn chats between them (bench.serve.prefix).

    trace.py     the seeded requests            client.py   streaming HTTP client, per-chunk times
    stats.py     percentiles, CDF plots         compare.py  --compare: serve the configs, same traces
    prefix.py    --workload shared-prefix       cli.py      arguments, one endpoint, main
    routing.py   ... --context-replicas N: KV-aware vs Serve's default router
    __main__.py  the command line's watchdog
"""

from bench.serve.cli import main

__all__ = ["main"]
