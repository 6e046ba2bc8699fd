"""Who has the two cores while a served model decodes: the serving replica's threads, one c = 1 run.

    python -m bench.serve_threads [--mode aggregated-in-ingress] [--requests 6] [--output-len 256]

Serves configs/smollm2.yaml in one of bench.serve_path's modes (the engine in the ingress by default),
warms it, then sends ``--requests`` requests one at a time (~400 random characters in, ``--output-len``
tokens out, ignore_eos) and reads, before and after, what Linux keeps per thread of the replica that
runs the engine (/proc/<pid>/task/<tid>: ``comm``, CPU time, ``schedstat``'s time spent runnable but
waiting for a core, voluntary and involuntary context switches) and the machine's CPU split
(/proc/stat). The engine's threads are named: ``engine-step`` (actors.engine_loop: the thread that runs
every step) and ``windserve-pool`` (engine/native/work_pool.cpp's helpers); the rest are Ray's, Serve's
and gRPC's. Linux only. Writes ``serve_threads.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

from bench.common import progress, write_json
from bench.serve.client import run_load
from bench.serve.compare import serving
from bench.serve.stats import summarize
from bench.serve.trace import make_trace
from bench.serve_path import CONFIG, MODEL, OVERRIDES

PROC_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


@dataclass(frozen=True)
class ThreadTimes:
    name: str
    cpu_s: float  # on a core (schedstat's first field)
    waiting_s: float  # runnable, waiting for a core (schedstat's second field)
    voluntary: int  # context switches: it slept (a lock, a queue, I/O)
    involuntary: int  # it was preempted


def read_thread(pid: int, tid: int) -> ThreadTimes | None:
    """One thread's counters, or None if it is gone."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/comm") as comm, open(f"{base}/schedstat") as schedstat, open(f"{base}/status") as status:
            name, (on_cpu, waiting, _), lines = comm.read().strip(), schedstat.read().split(), status.read()
    except (OSError, ValueError):
        return None
    switches = dict(line.split(":\t") for line in lines.splitlines() if "ctxt_switches" in line)
    return ThreadTimes(name, int(on_cpu) / 1e9, int(waiting) / 1e9, int(switches["voluntary_ctxt_switches"]),
                       int(switches["nonvoluntary_ctxt_switches"]))


def read_threads(pid: int) -> dict[int, ThreadTimes]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        times = read_thread(pid, int(tid))
        if times is not None:
            out[int(tid)] = times
    return out


def thread_deltas(before: dict[int, ThreadTimes], after: dict[int, ThreadTimes], wall_s: float,
                  min_cpu_s: float = 0.01) -> list[dict]:
    """Per thread that ran at least ``min_cpu_s`` between the two readings, busiest first."""
    rows = []
    for tid, end in after.items():
        start = before.get(tid, ThreadTimes(end.name, 0.0, 0.0, 0, 0))
        cpu = end.cpu_s - start.cpu_s
        if cpu >= min_cpu_s:
            rows.append({"tid": tid, "name": end.name, "cpu_s": cpu, "cpu_share_of_wall": cpu / wall_s,
                         "waiting_for_a_core_s": end.waiting_s - start.waiting_s,
                         "voluntary_switches": end.voluntary - start.voluntary,
                         "involuntary_switches": end.involuntary - start.involuntary})
    return sorted(rows, key=lambda row: -row["cpu_s"])


def machine_cpu_s() -> dict[str, float]:
    """The machine's CPU seconds so far, all cores, by /proc/stat's first line (nice: Ray's workers)."""
    with open("/proc/stat") as stat:
        ticks = stat.readline().split()[1:1 + len(PROC_STAT_FIELDS)]
    hz = os.sysconf("SC_CLK_TCK")
    return {field: int(value) / hz for field, value in zip(PROC_STAT_FIELDS, ticks)}


def engine_replica_pid(mode: str) -> int:
    """The pid of the Serve replica whose process holds the engine in ``mode``."""
    import psutil

    deployment = "Ingress" if "in-ingress" in mode else "Worker"
    for process in psutil.Process().children(recursive=True):
        try:
            title = process.cmdline()[0] if process.cmdline() else ""
        except psutil.Error:
            continue
        if title.startswith(f"ray::ServeReplica:{mode}:") and deployment in title:
            return process.pid
    raise RuntimeError(f"no Serve replica of {mode!r} holding the engine")


def measure(mode: str, requests: int, output_len: int, port: int, max_seconds: float) -> dict:
    trace = make_trace(requests, 400, output_len, spread=0.0, seed=1)
    with serving({mode: CONFIG}, port, max_seconds, {mode: OVERRIDES[mode]}) as urls:
        pid = engine_replica_pid(mode)
        asyncio.run(run_load(urls[mode], MODEL, trace[:1], 1, max_seconds))  # the step thread starts, the pool too
        threads, machine, started = read_threads(pid), machine_cpu_s(), time.monotonic()
        results, elapsed = asyncio.run(run_load(urls[mode], MODEL, trace, 1, max_seconds))
        wall_s = time.monotonic() - started
        threads_after, machine_after = read_threads(pid), machine_cpu_s()
    summary = summarize(results, elapsed)
    return {"mode": mode, "requests": requests, "output_len": output_len, "wall_s": wall_s,
            "itl_ms": summary["itl_ms"], "ttft_ms": summary["ttft_ms"],
            "output_tokens_per_s": summary["output_throughput"], "failed": summary["num_failed"],
            "machine_cpu_s": {k: machine_after[k] - machine[k] for k in PROC_STAT_FIELDS},
            "threads": thread_deltas(threads, threads_after, wall_s)}


def print_report(figures: dict) -> None:
    print(f"\n{figures['mode']}: ITL p50 {figures['itl_ms']['p50']:.2f} ms, mean {figures['itl_ms']['mean']:.2f}; "
          f"{figures['wall_s']:.1f} s")
    print("machine CPU s:", {k: round(v, 2) for k, v in figures["machine_cpu_s"].items()})
    print(f"{'thread':18s} {'tid':>7s} {'cpu s':>7s} {'of wall':>8s} {'waiting s':>10s} {'slept':>7s} "
          f"{'preempted':>9s}")
    for row in figures["threads"][:12]:
        print(f"{row['name']:18s} {row['tid']:7d} {row['cpu_s']:7.2f} {row['cpu_share_of_wall']:8.1%} "
              f"{row['waiting_for_a_core_s']:10.2f} {row['voluntary_switches']:7d} {row['involuntary_switches']:9d}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="aggregated-in-ingress", choices=sorted(OVERRIDES))
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--port", type=int, default=8291)
    parser.add_argument("--max-seconds", type=float, default=300.0)
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)
    progress(f"serving {CONFIG} as {args.mode}")
    figures = measure(args.mode, args.requests, args.output_len, args.port, args.max_seconds)
    print_report(figures)
    write_json(args.out, "serve_threads", figures)
    return figures


if __name__ == "__main__":
    main()
