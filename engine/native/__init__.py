"""Native CPU kernels, built on first use by torch's extension builder (a C++ compiler and
ninja; ~40 s once, then loaded from torch's extension cache).

Where the build fails (no compiler) or ``WINDSERVE_NATIVE=0``, :func:`paged_decode_kernel`
returns None and attention keeps its torch path (``engine.attention_plan``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform

logger = logging.getLogger(__name__)

_HERE = os.path.dirname(os.path.abspath(__file__))


def _machine_tag() -> str:
    """The build uses ``-march=native``: a cache shared by two kinds of CPU must not mix their builds."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha1(f"{platform.machine()} {flags}".encode()).hexdigest()[:10]


@functools.cache
def paged_decode_kernel():
    """``paged_decode(query, cache, layer, first_rows, query_lens, seq_lens, tables, window, scale, sinks, out)``
    (engine/native/paged_decode.cpp), or None."""
    if os.environ.get("WINDSERVE_NATIVE", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        module = load(name=f"windserve_paged_decode_{_machine_tag()}",
                      sources=[os.path.join(_HERE, "paged_decode.cpp")],
                      extra_cflags=["-O3", "-march=native", "-fopenmp-simd"], verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure means: use the torch path
        logger.warning("native paged decode kernel unavailable, attention keeps its torch path: %s", error)
        return None
    return module.paged_decode
