"""bench.serve_threads's /proc readers on this process's own threads: a thread that computes gains CPU time,
one that sleeps gains sleeps and no CPU time, and a thread's name is what the OS was told."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from actors.engine_loop import name_os_thread
from bench.serve_threads import ThreadTimes, machine_cpu_s, read_threads, thread_deltas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_busy_and_a_sleeping_thread_read_as_such():
    import os

    ready, done = threading.Barrier(3), threading.Event()
    tids = {}

    def busy():
        name_os_thread("probe-busy")
        tids["busy"] = threading.get_native_id()
        ready.wait()
        total = 0
        while not done.is_set():
            total += sum(range(1000))

    def sleepy():
        name_os_thread("probe-sleepy")
        tids["sleepy"] = threading.get_native_id()
        ready.wait()
        while not done.is_set():
            time.sleep(0.005)

    threads = [threading.Thread(target=busy), threading.Thread(target=sleepy)]
    for thread in threads:
        thread.start()
    ready.wait()
    before, machine, started = read_threads(os.getpid()), machine_cpu_s(), time.monotonic()
    time.sleep(0.5)
    after, machine_after = read_threads(os.getpid()), machine_cpu_s()
    done.set()
    for thread in threads:
        thread.join()
    rows = {row["tid"]: row for row in thread_deltas(before, after, time.monotonic() - started, min_cpu_s=0.0)}
    busy_row, sleepy_row = rows[tids["busy"]], rows.get(tids["sleepy"])
    assert busy_row["name"] == "probe-busy" and busy_row["cpu_s"] > 0.1
    assert after[tids["sleepy"]].name == "probe-sleepy"
    assert after[tids["sleepy"]].voluntary - before[tids["sleepy"]].voluntary >= 20  # ~100 sleeps of 5 ms
    assert sleepy_row is None or sleepy_row["cpu_s"] < busy_row["cpu_s"] / 5
    assert sum(machine_after.values()) > sum(machine.values())  # the machine's clock moved


def test_deltas_skip_idle_threads_and_sort_busiest_first():
    before = {1: ThreadTimes("a", 1.0, 0.1, 5, 1), 2: ThreadTimes("b", 2.0, 0.0, 0, 0)}
    after = {1: ThreadTimes("a", 3.0, 0.6, 9, 4), 2: ThreadTimes("b", 2.0, 0.0, 0, 0),
             3: ThreadTimes("c", 0.5, 0.2, 1, 0)}  # new since the first reading
    rows = thread_deltas(before, after, wall_s=4.0)
    assert [row["tid"] for row in rows] == [1, 3]
    assert rows[0] == {"tid": 1, "name": "a", "cpu_s": 2.0, "cpu_share_of_wall": 0.5, "waiting_for_a_core_s": 0.5,
                       "voluntary_switches": 4, "involuntary_switches": 3}
