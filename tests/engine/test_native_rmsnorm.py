"""The native RMSNorm (engine/native/rmsnorm.cpp): transformers' formula with the sum of squares in another
order, so within a float32 rounding of it; the model's RMSNorm takes it in float32 on the CPU."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import layers
from engine.native import rms_norm_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(rms_norm_kernel)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 20), hidden=st.integers(1, 3000), seed=st.integers(0, 2**16),
       eps=st.sampled_from([1e-5, 1e-6]))
def test_within_float32_rounding_of_the_formula(kernel, rows, hidden, seed, eps):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    weight = torch.randn(hidden, generator=gen)
    out = kernel(x, weight, eps)
    x64 = x.double()
    want = weight.double() * (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    torch.testing.assert_close(out.double(), want, rtol=2e-6, atol=1e-6)
    aten = torch.nn.functional.rms_norm(x, (hidden,), weight, eps)
    torch.testing.assert_close(out, aten, rtol=2e-6, atol=1e-6)
    for row in range(rows):  # a row's result does not depend on the others
        assert torch.equal(kernel(x[row:row + 1], weight, eps)[0], out[row])


def test_a_nan_stays_in_its_row(kernel):
    x = torch.randn(3, 70)
    x[1, 5] = float("nan")
    out = kernel(x, torch.ones(70), 1e-5)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


def test_bad_inputs_are_refused(kernel):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(torch.ones(8, 2).t(), torch.ones(8), 1e-5)


def test_model_norm_takes_the_kernel_in_float32_on_the_cpu(kernel):
    norm = layers.RMSNorm(96, 1e-5, scale_in_float32=True)
    norm.weight.data = torch.linspace(-2, 2, 96)
    x = torch.randn(2, 3, 96)  # leading dimensions kept
    calls = []
    counted = lambda *args: calls.append(1) or kernel(*args)  # noqa: E731
    with torch.no_grad(), mock.patch.object(layers, "rms_norm_kernel", lambda: counted):
        out = norm(x)
        assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16  # bf16: the formula, not the kernel
    assert len(calls) == 1 and out.shape == x.shape
    torch.testing.assert_close(out, kernel(x.reshape(6, 96), norm.weight, 1e-5).view(2, 3, 96), rtol=0, atol=0)
