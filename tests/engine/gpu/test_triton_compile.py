"""The Triton kernels compiled for an H100/H200 (sm_90) on the CPU: the interpreter runs a kernel as
Python and misses what only the compiler refuses (a non-constexpr global, a tl.dot side under 16, a
loop-carried type that changes), and the launcher's tile sizes must not spill registers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def usage() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT), "TRITON_DEFAULT_FP_FUSION": "1"}
    run = subprocess.run([sys.executable, "-m", "tests.engine.gpu.sm90_compile"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout)


def test_kernels_compile_for_sm90_with_tensor_cores_and_no_spills(usage):
    assert {name for name in usage if name.startswith("decode")} == {
        "decode bf16 G=8 D=128", "decode bf16 G=4 D=64", "decode fp32 G=4 D=64 split"}
    assert all(u["STACK"] == 0 and u["REG"] <= 255 for u in usage.values()), usage  # no spills
    # bf16 dots on tensor cores; float32 ones in IEEE float32 on purpose (TF32 would break exactness)
    assert [name for name, u in usage.items() if u["mma"]] == ["decode bf16 G=8 D=128", "decode bf16 G=4 D=64"]


def test_the_sampling_kernel_divides_exactly_and_fuses_nothing(usage):
    """engine.gpu.triton_sampling matches the torch ops bit for bit only if its PTX keeps every float32
    division IEEE (tl.div_rn; Triton's ``/`` is div.full) and fuses no multiply-add (enable_fp_fusion
    False, asked explicitly: Triton's default, TRITON_DEFAULT_FP_FUSION=1 here, fuses)."""
    sampling = {name: u for name, u in usage.items() if name.startswith("sample")}
    assert set(sampling) == {"sample bf16", "sample fp32 cut split"}
    for u in sampling.values():
        assert u["div_rn"] > 0 and u["div_approx"] == 0 and u["fma"] == 0 and u["approx_log"] == 0, u
