"""The native clamped SwiGLU (engine/native/swiglu.cpp) against transformers' operations run by torch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models.gpt_oss import Experts
from engine.native import clamped_swiglu_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(clamped_swiglu_kernel)


def _torch_ops(gate_up, alpha, limit):
    """transformers' GptOssExperts activation, op for op."""
    gate, up = gate_up[..., ::2].clamp(min=None, max=limit), gate_up[..., 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 300), width=st.integers(1, 70), scale=st.sampled_from([0.1, 3.0, 30.0]),
       num_nan=st.integers(0, 3), seed=st.integers(0, 10_000))
def test_matches_transformers_operations(kernel, rows, width, scale, num_nan, seed):
    """Any row count and width (16-lane blocks and the rest), values inside and far past the limits,
    NaN where it was (a broken input stays visible)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * width, generator=gen) * scale
    gate_up.view(-1)[torch.randint(0, gate_up.numel(), (num_nan,), generator=gen)] = float("nan")
    torch.testing.assert_close(kernel(gate_up, 1.702, 7.0), _torch_ops(gate_up, 1.702, 7.0),
                               rtol=2e-6, atol=2e-6, equal_nan=True)


def test_the_expert_layer_uses_it_in_float32_on_the_cpu(kernel, monkeypatch):
    experts = Experts(hidden_size=8, intermediate_size=20, num_experts=2, alpha=1.702, limit=7.0)
    gate_up = torch.randn(5, 40) * 5
    calls = []
    monkeypatch.setattr("engine.models.gpt_oss.clamped_swiglu_kernel", lambda: lambda *a: calls.append(a) or kernel(*a))
    torch.testing.assert_close(experts._activation(gate_up), _torch_ops(gate_up, 1.702, 7.0), rtol=2e-6, atol=2e-6)
    assert len(calls) == 1
    experts._activation(gate_up.bfloat16())  # bf16: torch's operations
    assert len(calls) == 1


def test_bad_inputs_are_refused(kernel):
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(2, 4, dtype=torch.float64), 1.0, 1.0)
    with pytest.raises(RuntimeError, match="2 \\* I"):
        kernel(torch.zeros(2, 3), 1.0, 1.0)
