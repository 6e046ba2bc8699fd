"""Triton's interpreter for every test here: TRITON_INTERPRET is read when a kernel is decorated, so it
is set before any test module imports engine.gpu's Triton modules (engine.gpu also checks it per call)."""

import os

os.environ["TRITON_INTERPRET"] = "1"
