"""Where the HTTP inter-token time goes: each token's hop times on the serving path (issue 29 item 3).

    python -m bench.serve_path [--quick] [--modes aggregated,disagg] [--concurrency 1,8]

1. The engine's own batch-1 decode step, in this process (``bench.quant_ab``'s engine: SmolLM2, its GGUF
   weights kept quantized), at 1 torch thread (a disaggregated generation worker's) and 2 (the
   aggregated worker's here), over the contexts the served c = 1 requests decode at (a prompt of their
   mean prompt tokens, then as many steps as they have output tokens). The report divides each served
   ITL p50 by the 2-thread step: issue 29's "HTTP ITL within 1.2x of the engine's own step". The box
   drifts by 20% over minutes, so the c = 1 phase also measures that step between its rounds of requests,
   every serving process stopped (SIGSTOP) meanwhile: the engine alone on the cores, in the same minute as
   the served tokens it is compared with (``interleaved``; each round's ITL p50 over the mean of the steps
   either side of it).
2. Per-token costs measured in this process: the incremental detokenizer's ``push``, a one-token
   ``RequestUpdate``'s pickle round trip (what Ray does to every streamed item), one SSE chunk's JSON.
3. configs/smollm2.yaml served in both modes at once (routes ``/aggregated`` and ``/disagg``, the
   aggregated one with ``torch_threads: 2`` as issue 29 ran it) with ``WINDSERVE_TRACE_PATH=1``: every
   update carries time.monotonic() stamps, and the ingress puts them in its SSE chunk::

        step_start ─► step_end ─► loop_get ─► worker_yield ─► ingress_recv ─► sse_out ─► client
        engine step   EngineLoop    worker       Serve + Ray     relay, run,     Serve's ASGI hop,
        (a thread)    queue, wakeup generators   (the hop)       formatter       proxy, HTTP, parse

   c = 1: requests alternate between the modes; c = 8: each mode in turn. Prompts of 400 random
   characters (~235 SmolLM2 tokens), 64 output tokens, ignore_eos (issue 29's client, bench.serve.client).
   ``--ingress haproxy`` (the default) puts HAProxy and each ingress replica's own HTTP server where
   Serve's Python proxy is (``--ingress proxy``; bench.serve.compare.INGRESSES).

Every process runs on the same cores, so a hop's CPU also slows the others' (the step above all):
compare the step under serving with (1). Writes ``serve_path.json``; the load (``uptime``) is in it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import time

import psutil

from bench.common import ainterleave, median, print_table, progress, write_json
from bench.engine_alone import AloneStep, serving_pids
from bench.peer_models import AGGREGATED
from bench.serve.client import RequestResult, run_alternating, run_load
from bench.serve.compare import INGRESSES, serving
from bench.serve.stats import percentiles_ms, summarize
from bench.serve.trace import make_trace

CONFIG = os.path.join("configs", "smollm2.yaml")
MODEL = "smollm2-135m-instruct"
OVERRIDES = {"aggregated": AGGREGATED,  # the aggregated run (torch_threads 2), disagg-only fields unset
             "disagg": {},
             # the same, its ingress calling the worker over Ray actor calls (AppConfig.handle_transport), for
             # an A/B of the worker -> ingress hop in one run: --modes aggregated,aggregated-ray
             "aggregated-ray": {**AGGREGATED, "handle_transport": "ray"},
             # the engine in the ingress replica (AppConfig.engine_in_ingress): no worker -> ingress hop at all;
             # --modes aggregated,aggregated-in-ingress A/Bs that hop in one run
             "aggregated-in-ingress": {**AGGREGATED, "engine_in_ingress": True}}
# (column, from stamp, to stamp): a token's hops, in path order
HOPS = (("step", "step_start", "step_end"), ("loop wakeup", "step_end", "loop_get"),
        ("worker relay", "loop_get", "worker_yield"), ("worker->ingress", "worker_yield", "ingress_recv"),
        ("ingress", "ingress_recv", "sse_out"), ("ingress->client", "sse_out", "client"),
        ("step end->client", "step_end", "client"))
IDLE_S = 15.0  # how long the idle CPU of every process is measured, after the warm-up
SIZES = {"full": dict(input_len=400, output_len=64, requests={1: 16, 8: 64}),
         "quick": dict(input_len=400, output_len=32, requests={1: 4, 8: 16})}
ROUND = 4  # c = 1 requests per mode between two measurements of the engine alone


def served_prompt_len(sizes: dict) -> int:
    """The mean prompt tokens of the c = 1 requests (their random text, tokenized as the server does)."""
    from engine.model_registry import resolve_model_path
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer(resolve_model_path(MODEL))
    trace = make_trace(sizes["requests"][1], sizes["input_len"], sizes["output_len"], spread=0.0, seed=1)
    return round(sum(len(tokenizer.encode(spec.prompt)) for spec in trace) / len(trace))


def micro_costs_us() -> dict[str, float]:
    """Per-token CPU costs of the path's own work, in microseconds (median of many)."""
    from app.streaming import sse_event
    from engine.model_registry import resolve_model_path
    from engine.outputs import RequestUpdate, TokenLogprob
    from engine.tokenizer import IncrementalDecoder, Tokenizer

    tokenizer = Tokenizer(resolve_model_path(MODEL))
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:256]
    decoder = IncrementalDecoder(tokenizer, prompt_ids=ids[:16])
    detok = [_timed_us(decoder.push, token) for token in ids[16:]]
    update = RequestUpdate("cmpl-0123456789abcdef", [1234], " fox", 400, 17)
    with_logprobs = RequestUpdate("cmpl-0123456789abcdef", [1234], " fox", 400, 17,
                                  logprobs=[TokenLogprob(1234, -0.5, ((1234, -0.5), (99, -1.5)))])
    chunk = {"id": "cmpl-0123456789abcdef", "object": "text_completion", "created": 0, "model": MODEL,
             "choices": [{"index": 0, "text": " fox", "logprobs": None, "finish_reason": None}]}
    return {"detokenize": median(detok),
            "pickle_update": median([_timed_us(_round_trip, update) for _ in range(2000)]),
            "pickle_update_logprobs": median([_timed_us(_round_trip, with_logprobs) for _ in range(2000)]),
            "pickled_update_bytes": float(len(pickle.dumps(update))),
            "sse_chunk_json": median([_timed_us(sse_event, chunk) for _ in range(2000)])}


def _round_trip(obj: object) -> object:
    return pickle.loads(pickle.dumps(obj, protocol=5))


def _timed_us(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e6


def breakdown(results: list[RequestResult]) -> dict[str, dict]:
    """Per hop, percentiles (ms) over every traced chunk but each request's first (token 0 is TTFT's)."""
    traces = [t for r in results if r.ok for t in r.traces[1:]]
    hops = {name: percentiles_ms([t[end] - t[start] for t in traces if start in t and end in t])
            for name, start, end in HOPS}
    idle = [b["step_start"] - a["step_end"] for r in results if r.ok for a, b in zip(r.traces[1:], r.traces[2:])
            if "step_start" in b and "step_end" in a]
    hops["engine idle"] = percentiles_ms(idle)  # c = 1: between a request's steps
    hops["tokens per chunk"] = {"p50": median([t["num_tokens"] for t in traces]) if traces else 0.0}
    return hops


def cpu_seconds() -> dict[str, float]:
    """CPU seconds so far of this process (the client) and of every process it started (Ray's), by
    process title (``ray::ServeReplica:<app>:<deployment>``, ``raylet``, ...) and pid."""
    out = {}
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            argv, times = process.cmdline(), process.cpu_times()
        except psutil.Error:
            continue
        is_ray_worker = bool(argv) and argv[0].startswith("ray::")  # a task's name follows the first "."
        title = argv[0].removeprefix("ray::").split(".")[0] if is_ray_worker else process.name()
        out[f"{title if process.pid != os.getpid() else 'client'} [{process.pid}]"] = (
            times.user + times.system + times.children_user + times.children_system)
    return out


def idle_cpu_rates(seconds: float) -> dict[str, float]:
    """Each process's CPU seconds per second with no request in flight (stats reports, polls)."""
    before = cpu_seconds()
    time.sleep(seconds)
    return {name: (spent - before.get(name, 0.0)) / seconds for name, spent in cpu_seconds().items()}


def cpu_ms_per_token(before: dict[str, float], after: dict[str, float], runs: dict, wall_s: float,
                     idle_rates: dict[str, float]) -> dict[str, dict[str, float]]:
    """Each process's CPU over the phase per output token of its application (all tokens for shared
    ones): ``all``, and ``less idle``, less what it spends idle over as long."""
    tokens = {mode: sum(r.num_output_tokens for r in results if r.ok) for mode, (results, _) in runs.items()}
    out = {}
    for name, seconds in after.items():
        mode = next((m for m in tokens if f":{m}:" in name), None)
        num_tokens = max(1, tokens[mode] if mode is not None else sum(tokens.values()))
        spent = seconds - before.get(name, 0.0)
        out[name] = {"all": 1e3 * spent / num_tokens,
                     "less idle": 1e3 * (spent - idle_rates.get(name, 0.0) * wall_s) / num_tokens}
    return dict(sorted(out.items(), key=lambda item: -item[1]["all"]))


def alternating_rounds(urls: dict[str, str], trace: list, max_seconds: float,
                       alone: AloneStep | None) -> tuple[dict, dict]:
    """c = 1: requests alternating between the modes, in rounds of ROUND; with ``alone``, the engine's step is
    measured before the first round and after each (serving stopped). Returns (runs, interleaved figures)."""
    pids = serving_pids()
    steps = [alone.ms_with_stopped(pids)] if alone else []
    runs: dict[str, tuple[list[RequestResult], float]] = {mode: ([], 0.0) for mode in urls}
    ratios: dict[str, list[float]] = {mode: [] for mode in urls}
    for first in range(0, len(trace), ROUND):
        round_runs = asyncio.run(run_alternating(urls, MODEL, trace[first:first + ROUND], max_seconds))
        if alone:
            steps.append(alone.ms_with_stopped(pids))
        for mode, (results, elapsed) in round_runs.items():
            runs[mode] = (runs[mode][0] + results, runs[mode][1] + elapsed)
            itl = summarize(results, elapsed)["itl_ms"]["p50"]
            if alone and itl is not None:
                ratios[mode].append(itl / ((steps[-2] + steps[-1]) / 2))
    interleaved = {"engine_step_ms": steps, "engine_step_ms_median": median(steps) if steps else None,
                   "itl_over_step_by_round": ratios,
                   "itl_over_step_median": {mode: median(r) if r else None for mode, r in ratios.items()}}
    return runs, interleaved


def measure(urls: dict[str, str], sizes: dict, concurrencies: list[int], max_seconds: float,
            alone: AloneStep | None) -> dict:
    idle_rates = idle_cpu_rates(IDLE_S)
    out: dict[str, dict] = {"idle cpu ms per s": {name: 1e3 * rate for name, rate in idle_rates.items()}}
    for c in concurrencies:
        trace = make_trace(sizes["requests"][c], sizes["input_len"], sizes["output_len"], spread=0.0, seed=c)
        cpu_before, started = cpu_seconds(), time.monotonic()
        alone_cpu_s, alone_wall_s = (alone.cpu_s, alone.wall_s) if alone else (0.0, 0.0)
        if c == 1:
            runs, out["interleaved c=1"] = alternating_rounds(urls, trace, max_seconds, alone)
        else:
            candidates = {mode: (lambda url=url, mode=mode, trace=trace, c=c:
                                 run_load(url, MODEL, trace, c, max_seconds, mode)) for mode, url in urls.items()}
            runs = {mode: rs[0] for mode, rs in asyncio.run(ainterleave(1, candidates)).items()}
        cpu_after = cpu_seconds()
        if alone:  # the engine-alone measurements ran in this process, the serving ones stopped
            cpu_after = {name: spent - (alone.cpu_s - alone_cpu_s if name.startswith("client [") else 0.0)
                         for name, spent in cpu_after.items()}
        wall_s = time.monotonic() - started - (alone.wall_s - alone_wall_s if alone else 0.0)
        load, cpu = os.getloadavg(), cpu_ms_per_token(cpu_before, cpu_after, runs, wall_s, idle_rates)
        for mode, (results, elapsed) in runs.items():
            out[f"{mode} c={c}"] = {"summary": summarize(results, elapsed), "hops_ms": breakdown(results),
                                    "load_average": load}
        out[f"cpu ms per token c={c}"] = cpu
        progress(f"c = {c} done (load {load[0]:.2f})")
    return out


def print_report(engine_ms: dict[int, float], micro: dict[str, float], runs: dict) -> None:
    print_table("engine's own batch-1 decode step (ms)", ["1 thread", "2 threads"], [[engine_ms[1], engine_ms[2]]])
    print_table("per-token costs (us)", list(micro), [list(micro.values())])
    names = [name for name, _, _ in HOPS] + ["engine idle"]
    rows = [[run, s["summary"]["itl_ms"]["p50"], itl_over_step(s["summary"]["itl_ms"]["p50"], engine_ms[2]),
             s["summary"]["output_throughput"], *(s["hops_ms"][n]["p50"] for n in names),
             s["hops_ms"]["tokens per chunk"]["p50"]]
            for run, s in runs.items() if "summary" in s]
    print_table("per token, p50 (ms)", ["run", "client ITL", "ITL / engine step (2 threads)", "out tok/s", *names,
                                        "tokens/chunk"], rows)
    interleaved = runs.get("interleaved c=1")
    if interleaved and interleaved["engine_step_ms"]:
        print_table("c = 1, the engine alone between rounds (serving stopped)",
                    ["mode", "engine step (ms), median", "ITL / step by round", "median"],
                    [[mode, interleaved["engine_step_ms_median"], " ".join(f"{r:.3f}" for r in ratios),
                      interleaved["itl_over_step_median"][mode]]
                     for mode, ratios in interleaved["itl_over_step_by_round"].items()])
    for run, cpu in runs.items():
        if run.startswith("cpu ms per token"):
            print_table(f"{run} (ms; shared processes: over both modes' tokens)",
                        ["process", "CPU ms/token", "less idle"],
                        [[name, ms["all"], ms["less idle"]] for name, ms in cpu.items() if ms["all"] >= 0.05])


def itl_over_step(itl_ms: float | None, step_ms: float | None) -> float | None:
    """Issue 29's ratio: the served ITL p50 over the engine's own batch-1 step (target: at most 1.2)."""
    return None if itl_ms is None or not step_ms else itl_ms / step_ms


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.serve_path", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 and 16 requests of 32 tokens")
    parser.add_argument("--modes", default="aggregated,disagg", help=f"comma-separated subset of {list(OVERRIDES)}")
    parser.add_argument("--no-engine-step", action="store_true", help="skip (1), the engine's own step")
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--port", type=int, default=8291, help="Serve's HTTP port (8000 may be taken)")
    parser.add_argument("--ingress", default="haproxy", choices=INGRESSES, help="what carries HTTP to the ingress")
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--out", default=os.path.join("bench", "out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    sizes = SIZES["quick" if args.quick else "full"]
    modes = args.modes.split(",")
    alone = None if args.no_engine_step else AloneStep(sizes["output_len"], served_prompt_len(sizes))
    engine_ms = {1: None, 2: None} if alone is None else {1: alone.ms(1), 2: alone.ms(2)}
    micro = micro_costs_us()
    progress(f"engine step {engine_ms} ms; per-token costs {json.dumps(micro)}")
    os.environ["WINDSERVE_TRACE_PATH"] = "1"  # before Ray starts: its worker processes inherit it
    with serving({mode: CONFIG for mode in modes}, args.port, args.max_seconds,
                 {mode: OVERRIDES[mode] for mode in modes}, ingress=args.ingress) as urls:
        runs = measure(urls, sizes, [int(c) for c in args.concurrency.split(",")], args.max_seconds, alone)
    figures = {"sizes": {**sizes, "requests": {str(k): v for k, v in sizes["requests"].items()}},
               "ingress": args.ingress, "engine_step_ms": engine_ms, "per_token_us": micro, "runs": runs}
    print_report(engine_ms, micro, runs)
    write_json(args.out, "serve_path", figures)
    return figures


if __name__ == "__main__":
    main()
