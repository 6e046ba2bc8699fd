"""engine.host_memory: freed activations stay in the process (no page faults to get them back)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# 30 rounds of what a step does: allocate three 8 MiB blocks, touch them, free them all; print the
# minor page faults of the last 20 rounds. By default glibc's threshold adapts to 8 MiB (blocks come
# from the heap) but it trims the heap whenever more than twice that lies free at its top, so every
# round faults its 6,144 pages in again.
_SCRIPT = """
import ctypes, resource, sys
sys.path.insert(0, {root!r})
from engine.host_memory import keep_freed_memory
tuned = keep_freed_memory() if {tune} else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
size = 8 << 20
def round_trip():
    blocks = [libc.malloc(size) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, size)
    for block in blocks:
        libc.free(block)
for _ in range(10):
    round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_trip()
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tune: bool, env: dict | None = None) -> tuple[str, int]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=root, tune=tune)], capture_output=True,
                         text=True, check=True, env={**os.environ, **(env or {})}, timeout=60).stdout.split()
    return out[0], int(out[1])


def test_freed_blocks_come_back_without_page_faults():
    tuned, faults = _faults(tune=True)
    assert tuned == "True"
    assert faults < 2048  # 20 rounds of 6,144 pages each: not even a block's worth faulted in
    untuned, default_faults = _faults(tune=False)
    assert untuned == "False" and default_faults > 20 * 2048  # what it prevents, on this glibc


def test_it_can_be_turned_off():
    tuned, _ = _faults(tune=True, env={"WINDSERVE_MALLOC_TUNING": "0"})
    assert tuned == "False"
