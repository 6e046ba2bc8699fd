"""Decorating engine.gpu's kernels with ``triton.jit`` on first use, once per mode.

Triton decides at decoration time whether a kernel is compiled for the GPU or run by its
interpreter (``TRITON_INTERPRET=1``, CPU tensors). Decorating at import would freeze whichever the
environment said when the module was first imported; here each kernel body is a plain function,
decorated lazily for the mode the call asks for, so CUDA tensors and interpreted CPU tensors can
both run in one process (a GPU machine running the CPU tests too).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import triton


@functools.cache
def jitted(body: Callable, is_interpreted: bool):
    """``triton.jit(body)``, compiled (False) or interpreted (True)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if is_interpreted else "0"
    try:
        return triton.jit(body)
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


def next_power_of_2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))
