"""Figures of a load run: latency percentiles per metric, throughput, CDF plots."""

from __future__ import annotations

import math

from bench.serve.client import RequestResult

PERCENTILES = (50, 90, 99)


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]  # noqa: E731
    return {f"p{p}": 1000 * pick(p) for p in PERCENTILES} | {"mean": 1000 * sum(ordered) / len(ordered)}


def summarize(results: list[RequestResult], elapsed_s: float) -> dict:
    ok = [r for r in results if r.ok]
    short = [r for r in ok if not r.is_long]
    num_output = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(results), "num_failed": len(results) - len(ok), "duration_s": elapsed_s,
        "request_throughput": len(ok) / elapsed_s, "output_throughput": num_output / elapsed_s,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles_ms([x for r in ok for x in r.itls_s]),
        "short_ttft_ms": percentiles_ms([r.ttft_s for r in short]),
        "short_itl_ms": percentiles_ms([x for r in short for x in r.itls_s]),
        "long_ttft_ms": percentiles_ms([r.ttft_s for r in ok if r.is_long]),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }


def summary_rows(label: str, s: dict) -> list[list]:
    return [[label, metric, *(s[f"{metric}_ms"][f"p{p}"] for p in PERCENTILES)]
            for metric in ("ttft", "tpot", "itl")]


def cdf(ax, values: list[float], label: str) -> None:
    ordered = sorted(1000 * v for v in values)
    ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], label=label)


def draw(plt, runs: dict[str, list[RequestResult]]) -> None:
    """One panel per metric (TTFT, ITL, TPOT), one line per run: latency CDFs."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    metrics = {"TTFT": lambda r: [r.ttft_s], "ITL": lambda r: r.itls_s, "TPOT": lambda r: [r.tpot_s]}
    for ax, (name, values) in zip(axes, metrics.items()):
        for label, results in runs.items():
            cdf(ax, [v for r in results if r.ok for v in values(r) if v is not None], label)
        ax.set(xlabel=f"{name} (ms)", ylabel="fraction of samples", title=f"{name} CDF", xscale="log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
