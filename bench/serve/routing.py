"""``--workload shared-prefix --context-replicas N``: the KV-aware router vs Serve's default router.

One config is served twice at once, on routes ``/kv`` and ``/default``, each
with N context replicas (and ``--generation-replicas`` generation ones):
``kv`` with app.routing's router (build_app's default), ``default`` with
Serve's own (power of two choices, ``RequestRouterConfig()``). The chat
trace (bench.serve.trace.make_chat_trace, every conversation with its own
system prompt) alternates request by request between them, as
bench.serve.prefix does. Figures per mode: context-side prefix hit rate
(/metrics deltas), TTFT p50 / p99.

Cache pressure (``--num-pages``, ``--conversations``): with every replica's
cache smaller than all conversations' prefixes together but larger than its
share, Serve's default router makes every replica cache every conversation
(each evicting the others: least recently used first), while the KV-aware
router keeps each conversation on one replica, so N replicas cache N times
what one can. This is the case a cache-aware router exists for.

Targets: hit rate (kv) >= 0.8 and >= 1.5x the default router's; TTFT p50 default / kv >= 1.5.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from bench.common import print_table, progress, ratio, write_json, write_plot
from bench.serve.compare import load_serve_config, serving
from bench.serve.prefix import mode_figures, run_workload
from bench.serve.stats import cdf
from bench.serve.trace import make_chat_trace

MODES = ("kv", "default")
SIZES = {
    "full": dict(num_conversations=8, num_turns=6, system_len=512, question_len=32, answer_len=16),
    "quick": dict(num_conversations=4, num_turns=3, system_len=128, question_len=16, answer_len=8),
}
HIT_RATE_TARGET = 0.8
HIT_RATIO_TARGET = 1.5
TTFT_TARGET = 1.5


def worker_options(args: argparse.Namespace, mode: str) -> dict[str, dict]:
    from ray.serve.config import RequestRouterConfig

    counts = {"ContextWorker": args.context_replicas, "GenerationWorker": args.generation_replicas}
    router = {} if mode == "kv" else {"request_router_config": RequestRouterConfig()}
    return {name: {"num_replicas": n, **router} for name, n in counts.items()}


def app_overrides(args: argparse.Namespace) -> dict[str, dict]:
    """Config args both modes are served with: every prompt through a context replica (the
    context router is what is measured), and ``--num-pages`` where given."""
    pages = {"num_pages": args.num_pages} if args.num_pages else {}
    return {mode: {"local_prefill_max_tokens": 0, **pages} for mode in MODES}


def routing_figures(runs: dict) -> dict:
    per_mode = {mode: mode_figures(*runs[mode]) for mode in MODES}
    kv, default = per_mode["kv"], per_mode["default"]
    hit_kv, hit_default = kv["hit_rate"].get("context", 0.0), default["hit_rate"].get("context", 0.0)
    return {
        "modes": per_mode,
        "hit_rate_kv": hit_kv,
        "hit_rate_kv_over_default": ratio(hit_kv, hit_default),
        "ttft_p50_default_over_kv": ratio(default["ttft_ms"]["p50"] or 0.0, kv["ttft_ms"]["p50"] or 0.0),
        "targets": {"hit_rate_kv": HIT_RATE_TARGET, "hit_rate_kv_over_default": HIT_RATIO_TARGET,
                    "ttft_p50_default_over_kv": TTFT_TARGET},
    }


def draw_routing(plt, runs: dict) -> None:
    _, ax = plt.subplots(figsize=(6, 4))
    for mode in MODES:
        cdf(ax, [r.ttft_s for r in runs[mode][0] if r.ok], f"{mode} router")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="shared-prefix chats: TTFT", xscale="log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def routing_compare(args: argparse.Namespace) -> dict:
    sizes = SIZES["quick" if args.quick else "full"]
    if args.turns:
        sizes = {**sizes, "num_turns": args.turns}
    if args.conversations:
        sizes = {**sizes, "num_conversations": args.conversations}
    trace = make_chat_trace(**sizes, seed=args.seed, private_every=1)
    progress(f"routing: {len(trace)} requests per mode, {args.context_replicas} context replicas ({sizes})")
    model = load_serve_config(args.config)[0]["args"]["model"]
    options = {mode: worker_options(args, mode) for mode in MODES}
    with serving(dict.fromkeys(MODES, args.config), args.port, args.max_seconds, app_overrides(args),
                 worker_options=options) as urls:
        runs = run_workload(urls, model, trace, args.max_seconds)
    figures = routing_figures(runs)
    write_json(args.out, "serve_routing", {"sizes": sizes, "seed": args.seed, "config": args.config,
                                           "context_replicas": args.context_replicas, "num_pages": args.num_pages,
                                           **figures, "requests": {m: [asdict(r) for r in runs[m][0]] for m in MODES}})
    write_plot(args.out, "serve_routing", lambda plt: draw_routing(plt, runs))
    print_routing(figures)
    return figures


def print_routing(figures: dict) -> None:
    rows = [[f"{mode} router", m["ttft_ms"]["p50"], m["ttft_ms"]["p99"], m["hit_rate"].get("context"),
             m["hit_rate"].get("generation"), m["cached_prompt_fraction"], m["num_failed"]]
            for mode, m in figures["modes"].items()]
    # "cached (usage)": the responses' cached_tokens / prompt_tokens, a cross-check of the /metrics
    # deltas (which a replaced replica, its counters restarting from 0, would skew).
    print_table("shared-prefix chats, routing", ["router", "TTFT p50 ms", "TTFT p99 ms", "hit rate context",
                                                 "hit rate generation", "cached (usage)", "failed"], rows)
    for name, target in figures["targets"].items():
        value = figures[name]
        verdict = "n/a" if value is None else ("met" if value >= target else "NOT met")
        print(f"{name} = {value if value is None else round(value, 2)} (target >= {target}: {verdict})")
