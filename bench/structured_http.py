"""What a JSON schema costs a served request: ITL and TTFT over HTTP, with the schema against without
(issue 47's targets: ITL p50 <= 1.15x at c = 1 and c = 8, TTFT <= 1.2x for a cached schema).

    python -m bench.structured_http [--requests 16] [--rounds 3] [--max-tokens 64] [--port 8000]

configs/smollm2.yaml served aggregated (bench.peer_models.AGGREGATED: one worker, 2 torch threads), one
app: both kinds of request go to the same server, so the box's drift hits both alike. Prompts of 400
random characters (~235 tokens, bench.serve.client's chat request), 64 output tokens, greedy, ignore_eos.
The constrained requests carry ``response_format`` json_schema with one string of at least 400
characters, so no request ends before ``max_tokens``. The schema is compiled by a warm-up request first:
the figures are of a cached schema.

c = 1: requests one at a time, plain and constrained in turn (order flipped every request). c = 8: a round
of ``--requests`` plain at 8 in flight, then the same constrained, order flipped every round. Writes
``structured_http.json`` with both kinds' summaries and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os

import httpx

from bench.common import print_table, progress, ratio, write_json
from bench.peer_models import AGGREGATED
from bench.serve.client import RequestResult, run_load, send
from bench.serve.compare import serving
from bench.serve.stats import summarize
from bench.serve.trace import RequestSpec, make_trace

CONFIG = os.path.join("configs", "smollm2.yaml")
MODEL = "smollm2-135m-instruct"
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 400}}, "required": ["text"]}
# ignore_eos off (a 400 with a grammar): the 400-character string cannot close within max_tokens anyway
RESPONSE_FORMAT = {"ignore_eos": False,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "long_text", "schema": SCHEMA}}}
KINDS = ("plain", "json_schema")


def with_schema(trace: list[RequestSpec]) -> list[RequestSpec]:
    return [dataclasses.replace(spec, extra_body=RESPONSE_FORMAT) for spec in trace]


def traces(num_requests: int, max_tokens: int, batch: int) -> dict[str, list[RequestSpec]]:
    """The two kinds' requests, prompts of the same length but new text for every kind and ``batch``: no
    prompt is in the prefix cache when it is sent."""
    return {"plain": make_trace(num_requests, 400, max_tokens, spread=0.0, seed=10 * batch + 1),
            "json_schema": with_schema(make_trace(num_requests, 400, max_tokens, spread=0.0, seed=10 * batch + 2))}


async def one_at_a_time(url: str, traces: dict[str, list[RequestSpec]],
                        max_seconds: float) -> dict[str, list[RequestResult]]:
    """The i-th request of each kind in turn, one request in flight, order flipped every pair."""
    results: dict[str, list[RequestResult]] = {kind: [] for kind in KINDS}
    async with httpx.AsyncClient(base_url=url.rstrip("/") + "/", timeout=max_seconds) as client:
        for i in range(len(traces["plain"])):
            for kind in (KINDS if i % 2 == 0 else KINDS[::-1]):
                results[kind].append(await send(client, MODEL, traces[kind][i], chat=True))
    return results


def concurrent_rounds(url: str, num_requests: int, max_tokens: int, concurrency: int, rounds: int,
                      max_seconds: float) -> dict[str, tuple[list[RequestResult], float]]:
    runs: dict[str, tuple[list[RequestResult], float]] = {kind: ([], 0.0) for kind in KINDS}
    for r in range(rounds):
        kinds = traces(num_requests, max_tokens, batch=r + 1)
        for kind in (KINDS if r % 2 == 0 else KINDS[::-1]):
            results, elapsed = asyncio.run(run_load(url, MODEL, kinds[kind], concurrency, max_seconds,
                                                    f"{kind} c={concurrency}", chat=True))
            runs[kind] = (runs[kind][0] + results, runs[kind][1] + elapsed)
    return runs


def figures_of(runs: dict[str, tuple[list[RequestResult], float]]) -> dict:
    summaries = {kind: summarize(results, elapsed) for kind, (results, elapsed) in runs.items()}
    plain, constrained = summaries["plain"], summaries["json_schema"]
    return {"summaries": summaries,
            "itl_p50_ratio": ratio(constrained["itl_ms"]["p50"], plain["itl_ms"]["p50"]),
            "ttft_p50_ratio": ratio(constrained["ttft_ms"]["p50"], plain["ttft_ms"]["p50"]),
            "tpot_p50_ratio": ratio(constrained["tpot_ms"]["p50"], plain["tpot_ms"]["p50"])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--max-seconds", type=float, default=600.0)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    out: dict[str, dict] = {}
    with serving({"aggregated": CONFIG}, args.port, args.max_seconds, {"aggregated": AGGREGATED}) as urls:
        url = urls["aggregated"]
        warm = asyncio.run(run_load(url, MODEL, with_schema(make_trace(1, 400, 4, seed=3)), 1, args.max_seconds,
                                    "warm-up", chat=True))
        if warm[0][0].ttft_s is None:
            raise RuntimeError(f"the constrained warm-up request failed: {warm[0][0].error}")
        results = asyncio.run(one_at_a_time(url, traces(args.requests, args.max_tokens, batch=0), args.max_seconds))
        out["c=1"] = figures_of({kind: (rs, sum(r.latency_s or 0.0 for r in rs)) for kind, rs in results.items()})
        progress(f"c = 1: ITL p50 ratio {out['c=1']['itl_p50_ratio']:.3f}")
        rounds = concurrent_rounds(url, args.requests, args.max_tokens, 8, args.rounds, args.max_seconds)
        out["c=8"] = figures_of(rounds)
        progress(f"c = 8: ITL p50 ratio {out['c=8']['itl_p50_ratio']:.3f}")
    out["load_average"] = os.getloadavg()
    rows = [[c, kind, s["num_failed"], s["ttft_ms"]["p50"], s["itl_ms"]["p50"], s["tpot_ms"]["p50"]]
            for c, figures in out.items() if c.startswith("c=") for kind, s in figures["summaries"].items()]
    print_table("JSON schema against plain, served (ms)",
                ["c", "kind", "failed", "TTFT p50", "ITL p50", "TPOT p50"], rows)
    for c in ("c=1", "c=8"):
        print(f"{c}: ITL p50 {out[c]['itl_p50_ratio']:.3f}x, TTFT p50 {out[c]['ttft_p50_ratio']:.3f}x, "
              f"TPOT p50 {out[c]['tpot_p50_ratio']:.3f}x")
    print(write_json(args.out, "structured_http", out))
    return out


if __name__ == "__main__":
    main()
