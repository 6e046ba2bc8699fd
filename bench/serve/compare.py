"""``--compare``: serve configs/disagg.yaml and configs/aggregated.yaml here, the same traces to each.

Ray starts in this process (``address="local"``, a new instance) and Serve on
127.0.0.1. Two seeded traces: ``low`` (concurrency 1, short prompts) and
``mix`` (long-short). By default both applications are served at once (routes
``/disagg`` and ``/aggregated``, each config's own args) so that the figures
are ratios measured side by side on a shared, noisy machine: ``low``
alternates request by request, ``mix`` runs A B B A (the idle application only
reports stats). ``in_turn`` serves one config at a time instead (start, run,
shut down, next). Figures: TTFT disagg / aggregated at low load, and the short
requests' ITL p99 and TTFT in the mix, per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import sys
import time

import httpx
import psutil

from bench.common import ainterleave, print_table, progress, ratio, start_ray, write_json, write_plot
from bench.serve.client import RequestResult, run_alternating, run_load
from bench.serve.stats import draw, summarize, summary_rows
from bench.serve.trace import make_trace

COMPARE_CONFIGS = {"disagg": "configs/disagg.yaml", "aggregated": "configs/aggregated.yaml"}
COMPARE_SIZES = {  # per phase: requests, concurrency, input/output lengths; long-short: long prompts
    "full": dict(low=dict(num_requests=64, concurrency=1, input_len=32, output_len=24),
                 mix=dict(num_requests=48, concurrency=8, input_len=32, output_len=48, long_input_len=1500,
                          long_fraction=0.15)),
    "quick": dict(low=dict(num_requests=8, concurrency=1, input_len=32, output_len=16),
                  mix=dict(num_requests=20, concurrency=6, input_len=32, output_len=32, long_input_len=1000,
                           long_fraction=0.2)),
}
NUM_WARMUP = 3
LOW_LOAD_TTFT_TARGET = 1.1  # issue #13: disaggregated TTFT within 1.1x of aggregated at low load


# --compare measures disaggregation itself: no prompt takes the local-prefill shortcut.
PURE_DISAGG = {"disagg": {"local_prefill_max_tokens": 0}}


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{url}/health not 200 within {timeout_s:.0f}s")


def load_serve_config(path: str) -> tuple[dict, dict]:
    """(the application entry, http_options) of a one-application Serve config."""
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    (application,) = config["applications"]
    for deployment in application.get("deployments", []):
        if set(deployment) - {"name", "num_replicas"} or deployment.get("num_replicas", 1) != 1:
            raise ValueError(f"{path}: --compare serves one replica per deployment, not {deployment}")
    return application, config.get("http_options", {})


# How HTTP reaches the ingress replica: Serve's Python proxy actor, or HAProxy forwarding to the replica's own
# HTTP server (Serve's direct ingress, RAY_SERVE_ENABLE_HA_PROXY=1; the binary comes with ray[serve] on Linux)
INGRESSES = ("proxy", "haproxy")


@contextlib.contextmanager
def ingress_environment(ingress: str):
    """RAY_SERVE_ENABLE_HA_PROXY as ``ingress`` needs it, while Ray starts (its processes inherit it) and runs."""
    if ingress not in INGRESSES:
        raise ValueError(f"ingress must be one of {INGRESSES}, not {ingress!r}")
    wanted, before = ("1" if ingress == "haproxy" else "0"), os.environ.get("RAY_SERVE_ENABLE_HA_PROXY")
    constants = sys.modules.get("ray.serve._private.constants")  # read once, when Serve is first imported
    if constants is not None and constants.RAY_SERVE_ENABLE_HA_PROXY != (wanted == "1"):
        raise RuntimeError(f"Ray Serve was imported in this process before ingress={ingress!r} was chosen")
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = wanted
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RAY_SERVE_ENABLE_HA_PROXY", None)
        else:
            os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = before


@contextlib.contextmanager
def serving(configs: dict[str, str], port: int | None, max_seconds: float, overrides: dict[str, dict] | None = None,
            worker_options: dict[str, dict] | None = None, ingress: str = "proxy"):
    """Serve every config at once (Ray started here, Serve on 127.0.0.1); yields {mode: base url}.

    One config keeps its own route prefix; several get ``/<mode>`` each. ``overrides[mode]``
    replaces some of that config's args (the same path may then be served twice, differing
    only there); ``worker_options[mode]`` is build_app_with's, by worker deployment name. Each
    is warmed up (first requests pay one-time costs); Serve and Ray are shut down on the
    way out. ``ingress`` (INGRESSES) picks what carries HTTP to the ingress replicas.
    """
    with ingress_environment(ingress):
        yield from _serving(configs, port, max_seconds, overrides, worker_options)


def _serving(configs: dict[str, str], port: int | None, max_seconds: float, overrides: dict[str, dict] | None,
             worker_options: dict[str, dict] | None):
    import ray
    from ray import serve

    from app.serve_app import build_app_with, start_serve

    loaded = {mode: load_serve_config(path) for mode, path in configs.items()}
    for mode, args in (overrides or {}).items():
        if mode not in loaded:
            continue
        application, http_options = loaded[mode]
        loaded[mode] = ({**application, "args": {**application["args"], **args}}, http_options)
    port = port or next(iter(loaded.values()))[1].get("port", 8000)
    if not port_is_free(port):
        raise RuntimeError(f"127.0.0.1:{port} is in use; pass --port")
    prefixes = {mode: (app.get("route_prefix", "/") if len(configs) == 1 else f"/{mode}")
                for mode, (app, _) in loaded.items()}
    start_ray(address="local", num_cpus=os.cpu_count())  # never a cluster someone else started
    try:
        start_serve(port)
        started = time.monotonic()
        serve.run_many([serve.RunTarget(build_app_with(app["args"], (worker_options or {}).get(mode)), name=mode,
                                        route_prefix=prefixes[mode])
                        for mode, (app, _) in loaded.items()])
        urls = {mode: f"http://127.0.0.1:{port}{prefix.rstrip('/')}" for mode, prefix in prefixes.items()}
        for mode, url in urls.items():
            wait_healthy(url, timeout_s=120)
            warmup = make_trace(NUM_WARMUP, 32, 8, seed=99) + make_trace(1, 1500, 4, seed=98)
            asyncio.run(run_load(f"{url}/v1", loaded[mode][0]["args"]["model"], warmup, 1, max_seconds))
        progress(f"serving {', '.join(configs.values())}: healthy and warm after {time.monotonic() - started:.0f}s")
        yield {mode: f"{url}/v1" for mode, url in urls.items()}
    finally:
        haproxies = haproxy_processes()
        serve.shutdown()
        ray.shutdown()
        for process in haproxies:  # Serve stops it; one its manager could not stop would keep the port
            with contextlib.suppress(psutil.Error):
                process.kill()


def haproxy_processes(parent: psutil.Process | None = None) -> list[psutil.Process]:
    """The HAProxy processes among ``parent``'s descendants (default: this process's; Serve's HAProxy ingress)."""
    found = []
    for process in (parent or psutil.Process()).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.name() == "haproxy":
                found.append(process)
    return found


def merged(runs: list[tuple[list[RequestResult], float]]) -> tuple[list[RequestResult], float]:
    return [r for results, _ in runs for r in results], sum(elapsed for _, elapsed in runs)


def compare_side_by_side(phases: dict, model: str, args: argparse.Namespace) -> dict[str, dict]:
    """Both configs served at once; low load alternates request by request, the mix runs ABBA."""
    with serving(COMPARE_CONFIGS, args.port, args.max_seconds, PURE_DISAGG) as urls:
        low = asyncio.run(run_alternating(urls, model, phases["low"][0], args.max_seconds))
        progress("low load done (alternating request by request)")
        trace, concurrency = phases["mix"]
        candidates = {mode: (lambda url=url, mode=mode: run_load(url, model, trace, concurrency, args.max_seconds,
                                                                  f"{mode} mix")) for mode, url in urls.items()}
        mix = asyncio.run(ainterleave(2, candidates))
    return {mode: {"low": low[mode], "mix": merged(mix[mode])} for mode in urls}


def compare_in_turn(phases: dict, model: str, args: argparse.Namespace) -> dict[str, dict]:
    """Each config alone: serve, run both phases, shut down, next."""
    out = {}
    for mode, path in COMPARE_CONFIGS.items():
        with serving({mode: path}, args.port, args.max_seconds, PURE_DISAGG) as urls:
            out[mode] = {phase: asyncio.run(run_load(urls[mode], model, trace, concurrency, args.max_seconds,
                                                     f"{mode} {phase}"))
                         for phase, (trace, concurrency) in phases.items()}
    return out


def compare_figures(summaries: dict[str, dict[str, dict]]) -> dict:
    d, a = summaries["disagg"], summaries["aggregated"]
    return {
        "low_ttft_p50_ratio": ratio(d["low"]["ttft_ms"]["p50"], a["low"]["ttft_ms"]["p50"]),
        "low_ttft_p90_ratio": ratio(d["low"]["ttft_ms"]["p90"], a["low"]["ttft_ms"]["p90"]),
        "low_ttft_target": LOW_LOAD_TTFT_TARGET,
        "mix_short_itl_p99_ratio": ratio(d["mix"]["short_itl_ms"]["p99"], a["mix"]["short_itl_ms"]["p99"]),
        "mix_short_ttft_p50_ratio": ratio(d["mix"]["short_ttft_ms"]["p50"], a["mix"]["short_ttft_ms"]["p50"]),
        "note": "both modes share the same CPU cores here: disaggregation cannot isolate decode from prefill "
                "the way it does with one GPU per worker",
    }


def compare(args: argparse.Namespace) -> dict:
    sizes = COMPARE_SIZES["quick" if args.quick else "full"]
    trace_args = {phase: {k: v for k, v in size.items() if k != "concurrency"} for phase, size in sizes.items()}
    phases = {"low": (make_trace(**trace_args["low"], seed=args.seed), sizes["low"]["concurrency"]),
              "mix": (make_trace(**trace_args["mix"], mix="long-short", seed=args.seed), sizes["mix"]["concurrency"])}
    model = load_serve_config(COMPARE_CONFIGS["disagg"])[0]["args"]["model"]
    raw = (compare_in_turn if args.in_turn else compare_side_by_side)(phases, model, args)
    summaries = {mode: {phase: summarize(*runs[phase]) for phase in phases} for mode, runs in raw.items()}
    figures = compare_figures(summaries)
    write_json(args.out, "serve_compare", {"sizes": sizes, "seed": args.seed, "in_turn": args.in_turn,
                                           "summaries": summaries, "figures": figures})
    write_plot(args.out, "serve_compare",
               lambda plt: draw(plt, {f"{m} {p}": raw[m][p][0] for m in raw for p in phases}))
    print_compare(summaries, figures)
    return figures


def print_compare(summaries: dict, figures: dict) -> None:
    rows = [row for mode, s in summaries.items() for phase in s for row in summary_rows(f"{mode} {phase}", s[phase])]
    print_table("latency (ms), same traces", ["run", "metric", "p50", "p90", "p99"], rows)
    print_table("long-short mix, short requests (ms)", ["mode", "ITL p99", "TTFT p50", "TTFT p99", "long TTFT p50",
                                                        "failed", "out tok/s"],
                [[m, s["mix"]["short_itl_ms"]["p99"], s["mix"]["short_ttft_ms"]["p50"],
                  s["mix"]["short_ttft_ms"]["p99"],
                  s["mix"]["long_ttft_ms"]["p50"], s["mix"]["num_failed"] + s["low"]["num_failed"],
                  s["mix"]["output_throughput"]] for m, s in summaries.items()])
    verdict = "met" if figures["low_ttft_p50_ratio"] <= LOW_LOAD_TTFT_TARGET else "NOT met"
    print(f"\nlow load TTFT p50 disagg/aggregated = {figures['low_ttft_p50_ratio']:.2f} "
          f"(target <= {LOW_LOAD_TTFT_TARGET}: {verdict})")
    print(f"mix short-request ITL p99 disagg/aggregated = {figures['mix_short_itl_p99_ratio']:.2f}")
    print(f"note: {figures['note']}")
