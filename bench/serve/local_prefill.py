"""``--workload local-prefill``: TTFT of a generation worker prefilling itself vs the context hop.

Conditional disaggregation (``local_prefill_max_tokens``) sends a prompt whose
uncached part is short to a generation worker that prefills it itself: no
context call, no lease, no KV pull. This measures where that pays: one config
is served twice at once, ``local`` (every prompt prefilled locally) and
``disagg`` (never), and unique prompts (no cache hits) of several lengths
alternate between them one request at a time. Figures: TTFT p50 per prompt
length per mode, their ratio, and the longest length at which local is not
slower: the default threshold is chosen from it.
"""

from __future__ import annotations

import argparse
import random

from bench.common import print_table, progress, ratio, write_json, write_plot
from bench.serve.compare import load_serve_config, serving
from bench.serve.prefix import run_workload
from bench.serve.stats import percentiles_ms
from bench.serve.trace import RequestSpec, random_text

MODES = ("local", "disagg")
LENGTHS = {"full": (32, 128, 512, 1024, 2048), "quick": (32, 256)}
REPS = {"full": 6, "quick": 2}
ALWAYS = 1_000_000


def make_length_trace(lengths: tuple[int, ...], reps: int, seed: int) -> list[RequestSpec]:
    """``reps`` unique prompts of each length (one token a character on windserve-tiny), interleaved."""
    rng = random.Random(seed)
    specs = [(length, random_text(rng, length)) for _ in range(reps) for length in lengths]
    return [RequestSpec(i, 0.0, text, 4) for i, (_, text) in enumerate(specs)]


def length_figures(trace: list[RequestSpec], runs: dict, lengths: tuple[int, ...]) -> dict:
    by_length = {}
    for length in lengths:
        indexes = {s.index for s in trace if len(s.prompt) == length}
        p50 = {mode: percentiles_ms([r.ttft_s for r in runs[mode][0] if r.ok and r.index in indexes])["p50"]
               for mode in MODES}
        by_length[length] = {"ttft_p50_ms": p50, "disagg_over_local": ratio(p50["disagg"] or 0, p50["local"] or 0)}
    pays = [n for n in lengths if by_length[n]["disagg_over_local"] >= 1.0]
    return {"by_length": by_length, "longest_length_local_not_slower": max(pays, default=0)}


def local_prefill(args: argparse.Namespace) -> dict:
    size = "quick" if args.quick else "full"
    trace = make_length_trace(LENGTHS[size], REPS[size], args.seed)
    progress(f"local-prefill: {len(trace)} requests per mode, lengths {LENGTHS[size]}")
    model = load_serve_config(args.config)[0]["args"]["model"]
    overrides = {"local": {"local_prefill_max_tokens": ALWAYS}, "disagg": {"local_prefill_max_tokens": 0}}
    with serving(dict.fromkeys(MODES, args.config), args.port, args.max_seconds, overrides) as urls:
        runs = run_workload(urls, model, trace, args.max_seconds)
    figures = length_figures(trace, runs, LENGTHS[size])
    failed = {mode: sum(not r.ok for r in runs[mode][0]) for mode in MODES}
    write_json(args.out, "serve_local_prefill", {"config": args.config, "seed": args.seed, "failed": failed,
                                                 **figures})
    write_plot(args.out, "serve_local_prefill", lambda plt: draw(plt, figures))
    rows = [[n, f["ttft_p50_ms"]["local"], f["ttft_p50_ms"]["disagg"], f["disagg_over_local"]]
            for n, f in figures["by_length"].items()]
    print_table("TTFT p50 (ms) by prompt length", ["prompt tokens", "local", "disagg", "disagg / local"], rows)
    progress(f"failed: {failed}; longest length where local is not slower: "
             f"{figures['longest_length_local_not_slower']}")
    return figures


def draw(plt, figures: dict) -> None:
    _, ax = plt.subplots(figsize=(6, 4))
    lengths = list(figures["by_length"])
    for mode in MODES:
        ax.plot(lengths, [figures["by_length"][n]["ttft_p50_ms"][mode] for n in lengths], "o-", label=mode)
    ax.set(xscale="log", xlabel="prompt tokens (uncached)", ylabel="TTFT p50 (ms)",
           title="prefill on the generation worker vs the context hop")
    ax.grid(alpha=0.3)
    ax.legend()
