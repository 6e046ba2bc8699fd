"""RMSNorm and RoPE: the fast float32 CPU paths (ATen's fused rms_norm, the native rotate_half) are
transformers' formulas bit for bit (the native rms_norm: tests/engine/test_native_rmsnorm.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import layers
from engine.models.layers import RMSNorm, apply_rope
from engine.native import rotate_half_kernel
from tests.engine.engine_fixtures import built_kernel


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
    with torch.no_grad(), mock.patch.object(layers, "rms_norm_kernel", lambda: None):  # ATen's path
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


def _rope_formula(x, cos, sin):
    """transformers' _apply_rotary_emb (GPT-OSS) / rotate_half (Llama): the same products and sums."""
    first, second = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), heads=st.integers(1, 9), half=st.integers(1, 80), extra_heads=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_float32_rope_is_the_formula_bit_for_bit(rows, heads, half, extra_heads, seed):
    """Including a view of the fused q/k/v rows (strided tokens), as the decoder passes it."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(rows, heads + extra_heads, 2 * half, generator=gen) * 5
    x, cos, sin = fused[:, :heads], torch.randn(rows, half, generator=gen), torch.randn(rows, half, generator=gen)
    expected = _rope_formula(x, cos, sin)
    assert torch.equal(apply_rope(x, cos, sin), expected)
    if rotate_half_kernel() is not None:  # the native kernel itself, whatever apply_rope chose
        assert torch.equal(rotate_half_kernel()(x, cos, sin), expected)


def test_rope_takes_the_native_kernel_for_float32_cpu_rows(monkeypatch):
    calls = []
    kernel = built_kernel(rotate_half_kernel)
    monkeypatch.setattr(layers, "rotate_half_kernel", lambda: lambda *a: calls.append(1) or kernel(*a))
    x, cos, sin = torch.randn(3, 2, 8), torch.randn(3, 4), torch.randn(3, 4)
    apply_rope(x, cos, sin)
    assert calls == [1]
    apply_rope(x.bfloat16(), cos.bfloat16(), sin.bfloat16())  # bf16: the torch formula
    assert calls == [1]
