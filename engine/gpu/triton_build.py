"""Triton's mode in this process, and engine.gpu's kernels decorated on first use in that mode.

Triton is compiled (GPU) or interpreted (``TRITON_INTERPRET=1``: kernels run as Python on CPU
tensors, how CI tests them) for a whole process: the mode is read when ``triton.language`` is first
imported, which decorates Triton's own library functions (``tl.cdiv``, ...) for it, and a kernel of
one mode cannot call those of the other. So this module reads the mode back from those functions
rather than from the environment (which may have changed since), and decorates each kernel body
(a plain function) for that same mode, whatever ``TRITON_INTERPRET`` says at the time.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@functools.cache
def is_interpreted() -> bool:
    """Whether this process's Triton runs kernels in its interpreter (fixed at its first import)."""
    return not isinstance(tl.standard.cdiv, JITFunction)


@functools.cache
def jitted(body: Callable):
    """``triton.jit(body)`` in the process's mode: ``triton.jit`` reads TRITON_INTERPRET when it decorates."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if is_interpreted() else "0"
    try:
        return triton.jit(body)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def next_power_of_2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))
