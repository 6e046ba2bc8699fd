"""The planner's simulator against served runs: one arrival trace, measured and simulated, side by side.

    python -m bench.planner_fidelity [--capacity bench/results/capacity_tiny_planner.json]
        [--duration 40] [--rate 1.5] [--out bench/results/planner_fidelity.json]

The trace (Poisson arrivals, log-normal prompt and output lengths, no prefix hit: fresh random
prompts) is sent to windserve served disaggregated on the tiny model at fixed P:D 1:1 and 2:1
(bench.planner_load: streamed, TTFT and TPOT as the client sees them), and replayed through
bench.planner_sim's Simulation at the same fixed P:D, priced by each capacity table given, profiled on
this machine (``python -m bench.profile``). ``local_prefill_max_tokens`` is 0, so every prompt goes
through a context replica as the simulator assumes. Reported: TTFT and TPOT p50 of both, and
simulated / measured (the issue's target: within 25%).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
from pathlib import Path

import httpx

from app.planner_capacity import CapacityTable
from bench.common import progress
from bench.planner_load import open_loop, poisson_arrivals
from bench.planner_policies import FixedPolicy
from bench.planner_sim import Simulation
from bench.planner_traces import Request

CAPACITY = "bench/results/capacity_tiny_planner.json"
CONFIGS = ((1, 1), (2, 1))
ENGINE = {"mode": "disagg", "model": "windserve-tiny", "device": "cpu", "tokens_per_block": 16, "num_pages": 512,
          "max_num_seqs": 64, "max_num_batched_tokens": 1024, "local_prefill_max_tokens": 0, "lease_s": 30}


def trace(duration_s: float, rate: float, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for t in poisson_arrivals(rate, duration_s, rng):
        prompt = int(min(1024, max(64, rng.lognormvariate(math.log(400), 0.5))))
        output = int(min(64, max(2, rng.lognormvariate(math.log(24), 0.5))))
        out.append(Request(t, prompt, 0, output))
    return out


def simulated(requests: list[Request], table: CapacityTable, p: int, d: int, duration_s: float) -> dict:
    sim = Simulation(requests, table, FixedPolicy(p, d), duration_s)
    sim.run()
    return _p50s([f.ttft_s for f in sim.finished], [f.tpot_s for f in sim.finished if f.tpot_s > 0],
                 len(sim.finished))


def served(base: str, requests: list[Request]) -> dict:
    arrivals = [(r.arrival_s, "trace", r.prompt_len, r.output_len) for r in requests]

    async def go():
        async with httpx.AsyncClient(base_url=base) as http:
            return await open_loop(http, arrivals, max_in_flight=64)

    outcomes = asyncio.run(go())
    complete = [o for o in outcomes if o.is_complete]
    return _p50s([o.ttft_s for o in complete], [o.tpot_s for o in complete if o.tpot_s is not None], len(complete))


def _p50s(ttfts: list[float], tpots: list[float], num: int) -> dict:
    return {"requests": num, "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
            "tpot_p50_s": round(statistics.median(tpots), 4) if tpots else None}


def run(capacity: str, duration_s: float, rate: float) -> dict:
    from ray import serve

    from app.serve_app import build_app_with
    from tests.serving import serving

    tables = {path: CapacityTable.load(path) for path in capacity.split(",")}
    requests = trace(duration_s, rate)
    rows = []
    warm = {f"p{p}d{d}": build_app_with(ENGINE, {"ContextWorker": {"num_replicas": p},
                                                 "GenerationWorker": {"num_replicas": d}}) for p, d in CONFIGS[:1]}
    with serving(warm) as base:
        for p, d in CONFIGS:
            name = f"p{p}d{d}"
            if name not in warm:
                serve.delete(next(iter(warm)))
                serve.run(build_app_with(ENGINE, {"ContextWorker": {"num_replicas": p},
                                                  "GenerationWorker": {"num_replicas": d}}),
                          name=name, route_prefix=f"/{name}")
            url = f"{base}/{name}"
            httpx.post(f"{url}/v1/completions", timeout=120, json={  # a first request: warm-up, not timed
                "model": "windserve-tiny", "prompt": [1] * 64, "max_tokens": 4, "ignore_eos": True})
            progress(f"{p}P{d}G: {len(requests)} requests over {duration_s:.0f} s")
            measured = served(url, requests)
            for path, table in tables.items():  # the model's side is cheap: every table on one measurement
                model = simulated(requests, table, p, d, duration_s)
                rows.append({"config": f"{p}P{d}G", "capacity": path, "measured": measured, "simulated": model,
                             "ttft_ratio": _ratio(model["ttft_p50_s"], measured["ttft_p50_s"]),
                             "tpot_ratio": _ratio(model["tpot_p50_s"], measured["tpot_p50_s"])})
    return {"capacity": capacity, "duration_s": duration_s, "rate": rate, "num_requests": len(requests),
            "prompt_median": statistics.median(r.prompt_len for r in requests),
            "output_median": statistics.median(r.output_len for r in requests), "rows": rows}


def _ratio(simulated_s: float | None, measured_s: float | None) -> float | None:
    return round(simulated_s / measured_s, 3) if simulated_s and measured_s else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default=CAPACITY, help="bench.profile JSON files, comma-separated")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=1.5)
    parser.add_argument("--out", default="bench/results/planner_fidelity.json")
    args = parser.parse_args(argv)
    result = run(args.capacity, args.duration, args.rate)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| config | capacity table | requests | TTFT p50 measured | simulated | sim/measured | "
          "TPOT p50 measured | simulated | sim/measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        m, s = row["measured"], row["simulated"]
        print(f"| {row['config']} | {Path(row['capacity']).stem} | {m['requests']} | {m['ttft_p50_s']} | "
              f"{s['ttft_p50_s']} | {row['ttft_ratio']} | "
              f"{m['tpot_p50_s']} | {s['tpot_p50_s']} | {row['tpot_ratio']} |")
    progress(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
