"""Keep freed host memory in the process instead of handing it back to the kernel after every step.

glibc's malloc serves large blocks (above a threshold it raises as blocks are freed, up to
32 MiB) with fresh ``mmap`` pages and trims the heap top back to the kernel. An engine step
frees and reallocates the same megabyte-sized activations every layer, so depending on the
allocation history the threshold can settle where every step faults its activations back in
page by page. Measured on the 2-core VM (windserve-tiny, 64 prompts at c = 32, process CPU
seconds, three runs per process, alternating processes): default malloc 0.50-0.56 s with 20 to
7,600 page faults per run, and in one process of three 0.69-0.72 s with 87,000-100,000; with
the thresholds fixed 0.50-0.55 s and 18-1,900 faults in every process.

:func:`keep_freed_memory` fixes them (``mallopt``): blocks up to 32 MiB come from the heap, and
the heap is trimmed only when 1 GiB lies free at its top. The resident size then stays at the
process's peak instead of following each step. It changes the whole process, so the engine
calls it once at start (CPU engines only); ``WINDSERVE_MALLOC_TUNING=0`` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks above it are always mmap'ed
TRIM_THRESHOLD = 1 << 30

_done = False


def keep_freed_memory() -> bool:
    """Fix glibc's malloc thresholds for this process; True if they are set (now or before)."""
    global _done
    if _done:
        return True
    if os.environ.get("WINDSERVE_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
