"""RMSNorm: the fused float32 CPU path is transformers' formula bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models.layers import RMSNorm


def _formula(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool) -> torch.Tensor:
    """transformers' LlamaRMSNorm / GptOssRMSNorm, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(dtype) if scale_in_float32 else weight * h.to(dtype)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), hidden=st.integers(1, 4096), seed=st.integers(0, 2**16),
       scale_in_float32=st.booleans(), eps=st.sampled_from([1e-5, 1e-6]))
def test_float32_rms_norm_is_the_formula_bit_for_bit(rows, hidden, seed, scale_in_float32, eps):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen) * torch.rand(rows, 1, generator=gen) * 8
    norm = RMSNorm(hidden, eps, scale_in_float32)
    norm.weight.data = torch.randn(hidden, generator=gen)
    with torch.no_grad():
        assert torch.equal(norm(x), _formula(x, norm.weight, eps, scale_in_float32))


@pytest.mark.parametrize("scale_in_float32", [False, True])
def test_bf16_rms_norm_keeps_the_formula(scale_in_float32):
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    norm = RMSNorm(96, 1e-5, scale_in_float32)
    norm.weight.data = torch.linspace(-2, 2, 96).to(torch.bfloat16)
    with torch.no_grad():
        out = norm(x)
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, _formula(x, norm.weight, 1e-5, scale_in_float32))
