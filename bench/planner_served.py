"""A served scaling run of the P:D planner: configs/autoscale.yaml on a multi-node ray.cluster_utils.Cluster.

    python -m bench.planner_served [--interval 8] [--out bench/results/planner_served.json]

What ``serve run configs/autoscale.yaml`` does (Serve started from the config's options, the config
deployed to its controller), on a Cluster of a head and two worker nodes on this machine, with a short
adjustment interval, a budget of 4 replicas, CPU-sized SLOs, a capacity table profiled here
(bench/results/capacity_tiny_planner.json) and Serve's metrics sampled every second over 4 s. Load
(bench.planner_load, open loop, Poisson):

    A  prompt-heavy      long prompts, 2 output tokens
    B  generation-heavy  short prompts, long outputs        (context replicas are removed here)
    C  prompt-heavy      as A, while B's streams finish     (generation replicas are removed here)

Recorded: every planner decision (its log line in the controller's log), every worker replica the
stats board (app.serve_workers.WorkerStats) listed, polled every 0.5 s, with its running count and
the request ids it handled, and every request as the client saw it. Checked (``checks``): after each
shift the P:D moves the way the phase asks within two intervals; every request a removed replica
held when the planner decided to remove it completed with all its tokens; no decision read a cold
replica's latency (the log's ``warm=`` counts against the replicas then running).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path

import httpx
import yaml

from bench.common import progress
from bench.planner_load import Outcome, open_loop, poisson_arrivals
from bench.planner_served_checks import cold_checks, direction_checks, planner_lines, removals

ROOT = Path(__file__).resolve().parents[1]
APP = "windserve"
CAPACITY = "bench/results/capacity_tiny_planner.json"
BUDGET = 4
TTFT_SLO_S, TPOT_SLO_S = 0.5, 0.015
# (phase, seconds, its streams: (requests/s, prompt tokens, output tokens), ...); sized from a first run
# (prefill ~9k tokens/s, decode 6-7 ms a token on this machine): C's long answers are the streams a
# generation replica removed in C still holds
PHASES = (("A", 40.0, ((3.5, 1500, 2),)), ("B", 50.0, ((4.0, 200, 160),)),
          ("C", 50.0, ((3.5, 1500, 2), (0.5, 200, 400))))
MAX_IN_FLIGHT = 48
START_S = 240.0


def served_config(port: int, interval_s: float) -> dict:
    """configs/autoscale.yaml, with this run's port, interval, budget, SLOs and capacity table."""
    config = yaml.safe_load((ROOT / "configs" / "autoscale.yaml").read_text())
    config["http_options"]["port"] = port
    app = config["applications"][0]
    app["args"] |= {"device": "cpu", "ttft_slo_s": TTFT_SLO_S, "tpot_slo_s": TPOT_SLO_S}
    app["autoscaling_policy"]["policy_kwargs"] |= {
        "adjustment_interval_s": interval_s, "ttft_slo_s": TTFT_SLO_S, "tpot_slo_s": TPOT_SLO_S,
        "max_total_replicas": BUDGET, "capacity_path": str(ROOT / CAPACITY)}
    for deployment in app["deployments"]:
        scaling = deployment["autoscaling_config"] = dict(deployment["autoscaling_config"])
        scaling |= {"metrics_interval_s": 1, "look_back_period_s": 4}
        if deployment["name"] != "Ingress":
            scaling["max_replicas"] = BUDGET - 1
    return config


def start_cluster():
    """A head (Serve's controller and proxy) and two worker nodes, on this machine; the driver connected."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, namespace="serve", log_to_driver=False)
    return cluster


def deploy(config: dict) -> None:
    """``serve run``'s path for a config file (ray.serve.scripts.run): start Serve, deploy the config."""
    from ray.serve._private import api as serve_api
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                   proxy_location=schema.proxy_location, controller_options=schema.controller_options)
    client.deploy_apps(schema, _blocking=False)


def wait_ready(base: str) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        try:
            reply = httpx.post(f"{base}/v1/completions", timeout=30, json={
                "model": "windserve-tiny", "prompt": [1, 2, 3], "max_tokens": 2, "ignore_eos": True})
            if reply.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError(f"the application did not answer within {START_S} s")


def arrivals(seed: int = 0) -> tuple[list[tuple[float, str, int, int]], dict[str, float]]:
    rng, out, starts, offset = random.Random(seed), [], {}, 0.0
    for phase, seconds, streams in PHASES:
        starts[phase] = offset
        for rate, prompt, output in streams:
            out += [(t, phase, prompt, output) for t in poisson_arrivals(rate, seconds, rng, offset)]
        offset += seconds
    return sorted(out), starts


async def poll_board(samples: list[dict], stop: asyncio.Event) -> None:
    """The stats board every 0.5 s: each worker replica's name, role, running count, recent request ids."""
    from ray import serve

    board = serve.get_deployment_handle("WorkerStats", app_name=APP)
    while not stop.is_set():
        try:
            entries = await board.snapshot.remote()
            samples.append({"t": time.time(), "replicas": [
                {"name": e["name"], "role": e["role"], "num_running": e.get("num_running", 0),
                 "ids": list(e.get("accounted_request_ids", ()))} for e in entries]})
        except Exception as exc:  # the board restarting: a gap in the samples, said so
            samples.append({"t": time.time(), "error": repr(exc)[:200]})
        await asyncio.sleep(0.5)


async def load_and_watch(base: str) -> tuple[list[Outcome], list[dict], float, dict[str, float]]:
    plan, starts = arrivals()
    samples: list[dict] = []
    stop = asyncio.Event()
    watcher = asyncio.ensure_future(poll_board(samples, stop))
    start = time.time()
    async with httpx.AsyncClient(base_url=base, limits=httpx.Limits(max_connections=MAX_IN_FLIGHT)) as http:
        outcomes = await open_loop(http, plan, MAX_IN_FLIGHT)
    await asyncio.sleep(15)  # the removals after the load ended, on the board
    stop.set()
    await watcher
    return outcomes, samples, start, starts


def summarize(outcomes: list[Outcome]) -> dict:
    rows = {}
    for phase, _, _ in PHASES:
        mine = [o for o in outcomes if o.phase == phase]
        ttfts = sorted(o.ttft_s for o in mine if o.ttft_s is not None)
        tpots = sorted(o.tpot_s for o in mine if o.tpot_s is not None)
        rows[phase] = {"requests": len(mine), "complete": sum(o.is_complete for o in mine),
                       "errors": sorted({o.error for o in mine if o.error})[:3],
                       "ttft_p50_s": _median(ttfts), "tpot_p50_s": _median(tpots)}
    return rows


def _median(values: list[float]) -> float | None:
    return round(values[len(values) // 2], 4) if values else None


def run(interval_s: float) -> dict:
    import ray
    from ray import serve

    from tests.serving import free_port

    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "30")  # a loaded machine: tests.serving
    cluster = start_cluster()
    try:
        port = free_port()
        deploy(served_config(port, interval_s))
        base = f"http://127.0.0.1:{port}"
        wait_ready(base)
        progress(f"serving on {base}; nodes: {len(ray.nodes())}; load for {sum(p[1] for p in PHASES):.0f} s")
        outcomes, samples, start, starts = asyncio.run(load_and_watch(base))
        decisions = [d for d in planner_lines(cluster.head_node.get_session_dir_path()) if d["t"] >= start - 60]
        nodes = {a.get("Address", {}).get("NodeID") for a in ray._private.state.actors().values()
                 if str(a.get("Name", "")).startswith(f"SERVE_REPLICA::{APP}#") and a.get("State") == "ALIVE"}
        return {"interval_s": interval_s, "budget": BUDGET, "slos": [TTFT_SLO_S, TPOT_SLO_S],
                "phases": [{"phase": p, "seconds": s, "streams": [dict(zip(("rate", "prompt", "output"), x))
                                                                    for x in xs]} for p, s, xs in PHASES],
                "nodes": len(ray.nodes()), "nodes_with_replicas": len(nodes - {None}),
                "direction": direction_checks(decisions, start, starts, interval_s, [p for p, _, _ in PHASES]),
                "removals": removals(samples, decisions, outcomes), "cold": cold_checks(decisions, samples),
                "requests": summarize(outcomes), "lost": sum(not o.is_complete for o in outcomes),
                "decisions": [{**d, "t": round(d["t"] - start, 1)} for d in decisions],
                "board_samples": len(samples)}
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def print_table(result: dict) -> None:
    print("| phase | requests | complete | TTFT p50 s | TPOT p50 s | P:D before | P:D moved to | intervals |")
    print("|---|---|---|---|---|---|---|---|")
    for check in result["direction"]:
        row = result["requests"][check["phase"]]
        print(f"| {check['phase']} | {row['requests']} | {row['complete']} | {row['ttft_p50_s']} | {row['tpot_p50_s']} "
              f"| {check['from']} | {check['to']} | {check['intervals_after_shift']} |")
    print("| removed replica | role | requests it held between the decision and its stop | of those complete | "
          "running after it (max) |")
    print("|---|---|---|---|---|")
    for r in result["removals"]:
        print(f"| {r['replica']} | {r['role']} | {r['in_flight_during_removal']} | {r['in_flight_completed']} | "
              f"{r['running_after_decision_max']} |")
    print(f"cold: {result['cold']}; requests not complete: {result['lost']}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=8.0, help="the planner's adjustment_interval_s")
    parser.add_argument("--out", default="bench/results/planner_served.json")
    args = parser.parse_args(argv)
    result = run(args.interval)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(result)
    progress(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
