"""The engine's own batch-1 decode step, timed alone: issue 29's denominator for the served ITL.

``bench.serve_path`` times it before Ray starts and, between rounds of served requests, with every process
it started stopped (SIGSTOP, then SIGCONT): the engine alone on the cores in the same minute as the served
tokens it is compared with. An idle Ray + Serve cluster beside it slows it by ~15% on the 2-core box, and
the box itself drifts by as much within minutes (docs/benchmarks.md, 2026-12-06 at af140d0).
"""

from __future__ import annotations

import os
import random
import signal
import time

import psutil

from bench.common import median, torch_threads


class AloneStep:
    """The quantized engine's batch-1 decode step (median ms), by torch threads: ``num_steps`` steps after a
    ``prompt_len``-token prompt, the contexts the served c = 1 requests decode at."""

    def __init__(self, num_steps: int, prompt_len: int):
        from bench.quant_ab import make_engine

        self.num_steps = num_steps
        self.prompt = [random.Random(0).randrange(1000, 40000) for _ in range(prompt_len)]
        self.engine = make_engine("auto", prompt_len + 4 * (num_steps + 2))
        self.count = [0]
        self.cpu_s = self.wall_s = 0.0  # spent in ms_with_stopped: not the served phase's

    def ms(self, threads: int) -> float:
        from bench.quant_ab import steps_of

        with torch_threads(threads):
            steps_of(self.engine, self.prompt, 2, self.count)  # warm
            return median(steps_of(self.engine, self.prompt, self.num_steps, self.count)[1]) * 1e3

    def ms_with_stopped(self, pids: list[int]) -> float:
        """The 2-thread step with every process in ``pids`` stopped (SIGSTOP, then SIGCONT whatever happens):
        Ray's and Serve's processes and their timers off the cores, as before Ray started."""
        stopped, cpu, wall = [], time.process_time(), time.monotonic()
        try:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                except ProcessLookupError:
                    pass
            wait_stopped(stopped)
            return self.ms(2)
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            self.cpu_s += time.process_time() - cpu
            self.wall_s += time.monotonic() - wall


def wait_stopped(pids: list[int], timeout_s: float = 1.0) -> None:
    """Until every process in ``pids`` is in state T (a signal lands when its process next runs in the kernel),
    or has exited, or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                    if f.read().rpartition(")")[2].split()[0] in ("T", "t", "Z", "X"):
                        break
            except OSError:
                break
            time.sleep(0.001)


def serving_pids() -> list[int]:
    """Every process this one started (Ray's, Serve's, HAProxy), not this one."""
    return [process.pid for process in psutil.Process().children(recursive=True)]
