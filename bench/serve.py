"""Serving latency and throughput against any OpenAI-compatible endpoint (like ``vllm bench serve``).

    python -m bench.serve --base-url http://127.0.0.1:8000/v1 --model windserve-tiny [--rate R | --concurrency C]
    python -m bench.serve --compare [--quick]     # configs/disagg.yaml, then configs/aggregated.yaml

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
process (Ray started with ``address="local"``, Serve on 127.0.0.1) and sends
the same two seeded traces to each: ``low`` (concurrency 1, short prompts) and
``mix`` (long-short). By default both applications are served at once (routes
``/disagg`` and ``/aggregated``, each config's own args) so that the figures are
ratios measured side by side on a shared, noisy machine: ``low`` alternates
request by request, ``mix`` runs A B B A (the idle application only reports
stats). ``--in-turn`` serves one config at a time instead (start, run, shut
down, next). Figures: TTFT disagg / aggregated at low load, and the short
requests' ITL p99 and TTFT in the mix, per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import math
import os
import random
import socket
import string
import time
from dataclasses import asdict, dataclass, field

import httpx

from bench.common import ainterleave, print_table, progress, ratio, write_json, write_plot

PERCENTILES = (50, 90, 99)
PROGRESS_EVERY_S = 10.0
COMPARE_CONFIGS = {"disagg": "configs/disagg.yaml", "aggregated": "configs/aggregated.yaml"}
COMPARE_SIZES = {  # per phase: requests, concurrency, input/output lengths; long-short: long prompts
    "full": dict(low=dict(num_requests=24, concurrency=1, input_len=32, output_len=24),
                 mix=dict(num_requests=48, concurrency=8, input_len=32, output_len=48, long_input_len=1500,
                          long_fraction=0.15)),
    "quick": dict(low=dict(num_requests=8, concurrency=1, input_len=32, output_len=16),
                  mix=dict(num_requests=20, concurrency=6, input_len=32, output_len=32, long_input_len=1000,
                           long_fraction=0.2)),
}
NUM_WARMUP = 3
LOW_LOAD_TTFT_TARGET = 1.2


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float
    prompt: str
    max_tokens: int
    is_long: bool = False


@dataclass
class RequestResult:
    index: int
    is_long: bool
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int | None = None
    num_output_tokens: int = 0

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.num_output_tokens - 1)


# --- the trace ---------------------------------------------------------------------------------

def spread_lengths(rng: random.Random, length: int, spread: float, num: int) -> list[int]:
    low, high = max(1, round(length * (1 - spread))), max(1, round(length * (1 + spread)))
    return [rng.randint(low, high) for _ in range(num)]


def random_text(rng: random.Random, num_chars: int) -> str:
    """Lowercase letters and spaces: one token each on a byte tokenizer (windserve-tiny)."""
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(num_chars))


def make_trace(num_requests: int, input_len: int, output_len: int, spread: float = 0.25, *, seed: int = 0,
               rate: float | None = None, mix: str = "none", long_input_len: int = 1500,
               long_fraction: float = 0.1) -> list[RequestSpec]:
    """The same arguments and seed give the same requests, byte for byte."""
    rng = random.Random(seed)
    inputs = spread_lengths(rng, input_len, spread, num_requests)
    outputs = spread_lengths(rng, output_len, spread, num_requests)
    is_long = [mix == "long-short" and i > 0 and rng.random() < long_fraction for i in range(num_requests)]
    arrival, trace = 0.0, []
    for i in range(num_requests):
        if rate is not None and i > 0:
            arrival += rng.expovariate(rate)
        length = spread_lengths(rng, long_input_len, spread, 1)[0] if is_long[i] else inputs[i]
        trace.append(RequestSpec(i, arrival, random_text(rng, length), outputs[i], is_long[i]))
    return trace


# --- the client --------------------------------------------------------------------------------

def is_token_chunk(choice: dict) -> bool:
    text = choice.get("text") or (choice.get("delta") or {}).get("content")
    return bool(text) or choice.get("finish_reason") is None


async def send(client: httpx.AsyncClient, model: str, spec: RequestSpec) -> RequestResult:
    """Stream one completion; the result records the chunk arrival times."""
    result = RequestResult(spec.index, spec.is_long)
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "completions", json=body) as reply:
            if reply.status_code != 200:
                raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:200]!r}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk, now = json.loads(line[len("data: "):]), time.perf_counter()
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if chunk.get("usage"):
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not any(map(is_token_chunk, chunk.get("choices") or [])):
                    continue  # the usage chunk, or a finish_reason-only chunk after the last token
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itls_s.append(now - last)
                last = now
        result.latency_s = time.perf_counter() - start
        if result.num_output_tokens == 0:  # no usage chunk: one token per chunk
            result.num_output_tokens = len(result.itls_s) + (result.ttft_s is not None)
        result.ok = result.ttft_s is not None and result.num_output_tokens == spec.max_tokens
        if not result.ok:
            result.error = f"{result.num_output_tokens} of {spec.max_tokens} tokens"
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    return result


async def run_load(base_url: str, model: str, trace: list[RequestSpec], concurrency: int | None,
                   max_seconds: float, label: str = "", timeout_s: float = 120.0) -> tuple[list[RequestResult], float]:
    """Send ``trace`` at its arrival times, at most ``concurrency`` in flight; (results, wall seconds).

    Requests still unanswered after ``max_seconds`` are cancelled and count as failed.
    """
    limit = asyncio.Semaphore(concurrency or len(trace))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=(concurrency or len(trace)) + 4)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(spec: RequestSpec) -> None:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - start)))
            async with limit:
                results.append(await send(client, model, spec))

        tasks = [asyncio.create_task(one(spec)) for spec in trace]
        reporter = asyncio.create_task(_report_progress(label, results, len(trace), start))
        _, pending = await asyncio.wait(tasks, timeout=max_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        reporter.cancel()
        elapsed = time.perf_counter() - start
    answered = {r.index for r in results}
    results += [RequestResult(s.index, s.is_long, error=f"not finished within {max_seconds:.0f}s")
                for s in trace if s.index not in answered]
    return sorted(results, key=lambda r: r.index), elapsed


async def _report_progress(label: str, results: list[RequestResult], total: int, start: float) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        failed = sum(not r.ok for r in results)
        progress(f"{label} {len(results)}/{total} done, {failed} failed, {time.perf_counter() - start:.0f}s")


# --- figures -----------------------------------------------------------------------------------

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


# --- one endpoint ------------------------------------------------------------------------------

def trace_from_args(args: argparse.Namespace) -> list[RequestSpec]:
    return make_trace(args.num_requests, args.input_len, args.output_len, args.spread, seed=args.seed,
                      rate=args.rate, mix=args.mix, long_input_len=args.long_input_len,
                      long_fraction=args.long_fraction)


def bench_endpoint(args: argparse.Namespace) -> dict:
    trace = trace_from_args(args)
    progress(f"{len(trace)} requests to {args.base_url} ({args.model}), "
             f"{'rate %.2f/s' % args.rate if args.rate else 'all at once'}, concurrency {args.concurrency}")
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


# --- --compare: serve the configs, same traces to each ----------------------------------------

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


def start_ray(num_tries: int = 2) -> None:
    """A new local Ray instance (never a cluster someone else started); one retry: on a loaded
    machine its node can miss Ray's own startup timeout."""
    import ray

    for attempt in range(1, num_tries + 1):
        try:
            ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
            return
        except Exception as exc:  # Ray raises a bare Exception on a startup timeout
            ray.shutdown()
            if attempt == num_tries:
                raise
            progress(f"ray.init failed ({exc}); retrying")


@contextlib.contextmanager
def serving(configs: dict[str, str], port: int | None, max_seconds: float):
    """Serve every config at once (Ray started here, Serve on 127.0.0.1); yields {mode: base url}.

    One config keeps its own route prefix; several get ``/<mode>`` each. Each is warmed up
    (first requests pay one-time costs); Serve and Ray are shut down on the way out.
    """
    import ray
    from ray import serve

    from app.serve_app import build_app

    loaded = {mode: load_serve_config(path) for mode, path in configs.items()}
    port = port or next(iter(loaded.values()))[1].get("port", 8000)
    if not port_is_free(port):
        raise RuntimeError(f"127.0.0.1:{port} is in use; pass --port")
    prefixes = {mode: (app.get("route_prefix", "/") if len(configs) == 1 else f"/{mode}")
                for mode, (app, _) in loaded.items()}
    start_ray()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        started = time.monotonic()
        serve.run_many([serve.RunTarget(build_app(app["args"]), name=mode, route_prefix=prefixes[mode])
                        for mode, (app, _) in loaded.items()])
        urls = {mode: f"http://127.0.0.1:{port}{prefix.rstrip('/')}" for mode, prefix in prefixes.items()}
        for mode, url in urls.items():
            wait_healthy(url, timeout_s=120)
            warmup = make_trace(NUM_WARMUP, 32, 8, seed=99) + make_trace(1, 1500, 4, seed=98)
            asyncio.run(run_load(f"{url}/v1", loaded[mode][0]["args"]["model"], warmup, 1, max_seconds))
        progress(f"serving {', '.join(configs.values())}: healthy and warm after {time.monotonic() - started:.0f}s")
        yield {mode: f"{url}/v1" for mode, url in urls.items()}
    finally:
        serve.shutdown()
        ray.shutdown()


async def run_alternating(urls: dict[str, str], model: str, trace: list[RequestSpec],
                          max_seconds: float) -> dict[str, tuple[list[RequestResult], float]]:
    """One request at a time, each spec sent to every mode in turn (order flipped every spec)."""
    modes, results = list(urls), {mode: [] for mode in urls}
    clients = {mode: httpx.AsyncClient(base_url=url.rstrip("/") + "/", timeout=max_seconds)
               for mode, url in urls.items()}
    deadline = time.perf_counter() + max_seconds
    try:
        for spec in trace:
            for mode in (modes if spec.index % 2 == 0 else modes[::-1]):
                results[mode].append(await send(clients[mode], model, spec) if time.perf_counter() < deadline else
                                     RequestResult(spec.index, spec.is_long, error="past --max-seconds"))
    finally:
        for client in clients.values():
            await client.aclose()
    return {mode: (rs, sum(r.latency_s or 0.0 for r in rs)) for mode, rs in results.items()}


def merged(runs: list[tuple[list[RequestResult], float]]) -> tuple[list[RequestResult], float]:
    return [r for results, _ in runs for r in results], sum(elapsed for _, elapsed in runs)


def compare_side_by_side(phases: dict, model: str, args: argparse.Namespace) -> dict[str, dict]:
    """Both configs served at once; low load alternates request by request, the mix runs ABBA."""
    with serving(COMPARE_CONFIGS, args.port, args.max_seconds) as urls:
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
        with serving({mode: path}, args.port, args.max_seconds) as urls:
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    parser.add_argument("--quick", action="store_true", help="--compare with the smallest sizes (~2 min)")
    parser.add_argument("--in-turn", action="store_true",
                        help="--compare: serve one config at a time (default: both at once, requests alternating)")
    parser.add_argument("--port", type=int, default=None, help="--compare: port instead of the configs' own")
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    faulthandler.dump_traceback_later(900 if args.compare else args.max_seconds + 120, exit=True)  # never hang
    return compare(args) if args.compare else bench_endpoint(args)


if __name__ == "__main__":
    main()
