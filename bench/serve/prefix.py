"""``--workload shared-prefix``: multi-turn chats over a shared system prompt, prefix cache on vs off.

One config (``--config``, configs/disagg.yaml by default) is served twice at
once, on routes ``/on`` and ``/off`` that differ only in
``enable_prefix_caching``; with ``--off-url`` two running endpoints are
measured instead (``--base-url`` is the one with the cache on). The chat
trace (bench.serve.trace.make_chat_trace) goes to both one request at a
time, each request to ``on`` and ``off`` in turn (order flipped every
request), so a noisy neighbour slows both alike.

Figures, per mode, from the requests and from /metrics deltas over the run::

    TTFT p50 / p99            client-side, streamed
    hit rate, per role        prefix_cache_hits / prefix_cache_queries (tokens)
    cached prompt fraction    usage.prompt_tokens_details.cached_tokens / prompt_tokens
    KV bytes per request      generation workers' kv_transfer_bytes / requests

Targets: TTFT p50 off / on >= 2; KV bytes per request off / on >= 3.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import asdict

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import print_table, progress, ratio, write_json, write_plot
from bench.serve.client import RequestResult, run_alternating
from bench.serve.compare import load_serve_config, serving
from bench.serve.stats import cdf, percentiles_ms
from bench.serve.trace import RequestSpec, make_chat_trace

MODES = ("on", "off")
SIZES = {  # conversations run in rounds of turns; lengths in tokens (one per character on windserve-tiny)
    "full": dict(num_conversations=6, num_turns=4, system_len=1024, question_len=48, answer_len=24),
    "quick": dict(num_conversations=2, num_turns=2, system_len=128, question_len=16, answer_len=8),
}
COUNTERS = {"prefix_cache_queries": "windserve_prefix_cache_queries_total",
            "prefix_cache_hits": "windserve_prefix_cache_hits_total",
            "kv_transfer_bytes": "windserve_kv_transfer_bytes_total"}
TTFT_TARGET = 2.0
BYTES_TARGET = 3.0
SETTLE_POLL_S = 1.2  # just over the workers' stats report period (app.serve_workers.REPORT_PERIOD_S)


def worker_counters(url: str) -> dict[str, dict[str, float]]:
    """role -> {stats key: value summed over that role's workers}, from ``GET /metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    names = {name: key for key, name in COUNTERS.items()}
    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                role = out.setdefault(sample.labels.get("role", ""), dict.fromkeys(COUNTERS, 0.0))
                role[names[sample.name]] += sample.value
    return out


def settled_counters(url: str, max_wait_s: float = 10.0) -> dict[str, dict[str, float]]:
    """``worker_counters`` once two reads a report period apart agree (the workers push stats every second)."""
    deadline, latest = time.monotonic() + max_wait_s, worker_counters(url)
    while time.monotonic() < deadline:
        time.sleep(SETTLE_POLL_S)
        previous, latest = latest, worker_counters(url)
        if latest == previous:
            break
    return latest


def counter_deltas(before: dict, after: dict) -> dict[str, dict[str, float]]:
    return {role: {key: value - before.get(role, {}).get(key, 0.0) for key, value in counters.items()}
            for role, counters in after.items()}


def run_workload(urls: dict[str, str], model: str, trace: list[RequestSpec], max_seconds: float) -> dict:
    """{mode: (results, /metrics deltas by role)}: the trace alternated over ``urls`` (``.../v1``)."""
    apps = {mode: url.removesuffix("/v1") for mode, url in urls.items()}
    before = {mode: settled_counters(app) for mode, app in apps.items()}
    runs = asyncio.run(run_alternating(urls, model, trace, max_seconds))
    after = {mode: settled_counters(app) for mode, app in apps.items()}
    return {mode: (runs[mode][0], counter_deltas(before[mode], after[mode])) for mode in urls}


def mode_figures(results: list[RequestResult], deltas: dict[str, dict[str, float]]) -> dict:
    ok = [r for r in results if r.ok]
    prompt_tokens = sum(r.num_prompt_tokens or 0 for r in ok)
    moved = sum(d["kv_transfer_bytes"] for role, d in deltas.items() if role == "generation")
    return {
        "num_requests": len(results), "num_failed": len(results) - len(ok),
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
        "hit_rate": {role: ratio(d["prefix_cache_hits"], d["prefix_cache_queries"]) for role, d in deltas.items()
                     if d["prefix_cache_queries"] > 0},
        "cached_prompt_fraction": ratio(sum(r.num_cached_tokens for r in ok), prompt_tokens),
        "kv_bytes_per_request": moved / len(ok) if "generation" in deltas and ok else None,
        "metrics_deltas": deltas,
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def workload_figures(runs: dict) -> dict:
    per_mode = {mode: mode_figures(*runs[mode]) for mode in MODES}
    on, off = per_mode["on"], per_mode["off"]
    bytes_on, bytes_off = on["kv_bytes_per_request"], off["kv_bytes_per_request"]
    return {
        "modes": per_mode,
        "ttft_p50_off_over_on": ratio(off["ttft_ms"]["p50"] or 0.0, on["ttft_ms"]["p50"] or 0.0),
        "ttft_p99_off_over_on": ratio(off["ttft_ms"]["p99"] or 0.0, on["ttft_ms"]["p99"] or 0.0),
        "kv_bytes_off_over_on": None if bytes_on is None else ratio(bytes_off, bytes_on),
        "targets": {"ttft_p50_off_over_on": TTFT_TARGET, "kv_bytes_off_over_on": BYTES_TARGET},
    }


def draw_workload(plt, trace: list[RequestSpec], runs: dict, figures: dict) -> None:
    """TTFT CDFs, mean TTFT by turn, and KV bytes per request: cache on vs off."""
    turn_of = {spec.index: spec.turn for spec in trace}
    _, (ax_cdf, ax_turn, ax_bytes) = plt.subplots(1, 3, figsize=(14, 4))
    for mode in MODES:
        ok = [r for r in runs[mode][0] if r.ok]
        cdf(ax_cdf, [r.ttft_s for r in ok], f"cache {mode}")
        turns = sorted({turn_of[r.index] for r in ok})
        means = [1000 * sum(r.ttft_s for r in ok if turn_of[r.index] == t) /
                 sum(turn_of[r.index] == t for r in ok) for t in turns]
        ax_turn.plot(turns, means, marker="o", label=f"cache {mode}")
    ax_cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", xscale="log")
    ax_turn.set(xlabel="turn", ylabel="mean TTFT (ms)", title="TTFT by turn", xticks=sorted(set(turn_of.values())))
    per_request = [figures["modes"][mode]["kv_bytes_per_request"] or 0.0 for mode in MODES]
    ax_bytes.bar([f"cache {mode}" for mode in MODES], [b / 2**20 for b in per_request], color=["C0", "C1"])
    ax_bytes.set(ylabel="MiB per request", title="KV bytes moved context -> generation")
    for ax in (ax_cdf, ax_turn):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def shared_prefix(args: argparse.Namespace) -> dict:
    """The workload of the module docstring: serve (or use the given endpoints), run, report."""
    sizes = SIZES["quick" if args.quick else "full"]
    trace = make_chat_trace(**sizes, seed=args.seed)
    progress(f"shared-prefix: {len(trace)} requests per mode ({sizes})")
    if args.off_url:
        runs = run_workload({"on": args.base_url, "off": args.off_url}, args.model, trace, args.max_seconds)
    else:
        model = load_serve_config(args.config)[0]["args"]["model"]
        overrides = {mode: {"enable_prefix_caching": mode == "on"} for mode in MODES}
        with serving(dict.fromkeys(MODES, args.config), args.port, args.max_seconds, overrides) as urls:
            runs = run_workload(urls, model, trace, args.max_seconds)
    figures = workload_figures(runs)
    write_json(args.out, "serve_prefix", {"sizes": sizes, "seed": args.seed, "config": args.config,
                                          **figures, "requests": {m: [asdict(r) for r in runs[m][0]] for m in MODES}})
    write_plot(args.out, "serve_prefix", lambda plt: draw_workload(plt, trace, runs, figures))
    print_workload(figures)
    return figures


def print_workload(figures: dict) -> None:
    roles = sorted({role for m in figures["modes"].values() for role in m["hit_rate"]})
    rows = [[f"cache {mode}", m["ttft_ms"]["p50"], m["ttft_ms"]["p99"], *(m["hit_rate"].get(r) for r in roles),
             m["cached_prompt_fraction"], m["kv_bytes_per_request"], m["num_failed"]]
            for mode, m in figures["modes"].items()]
    print_table("shared-prefix chats", ["mode", "TTFT p50 ms", "TTFT p99 ms", *(f"hit rate {r}" for r in roles),
                                        "cached (usage)", "KV bytes/req", "failed"], rows)
    for name, target in figures["targets"].items():
        value = figures[name]
        verdict = "n/a" if value is None else ("met" if value >= target else "NOT met")
        print(f"{name} = {value if value is None else round(value, 2)} (target >= {target}: {verdict})")
