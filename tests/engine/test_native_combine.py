"""The native MoE combine step (engine/native/combine.cpp) against torch's ``index_add_``, and the expert
layer with it against the layer without it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import gpt_oss
from engine.native import add_weighted_rows_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(add_weighted_rows_kernel)


@settings(max_examples=80, deadline=None)
@given(num_tokens=st.integers(1, 40), num_rows=st.integers(0, 120), width=st.integers(1, 70),
       seed=st.integers(0, 10_000))
def test_same_bits_as_index_add_of_the_scaled_rows(kernel, num_tokens, num_rows, width, seed):
    """Rows added in their order, each scaled then added (two roundings, as the two torch ops)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, num_tokens, (num_rows,), generator=gen)
    rows, weights = torch.randn(num_rows, width, generator=gen), torch.rand(num_rows, generator=gen)
    start = torch.randn(num_tokens, width, generator=gen)
    out = start.clone()
    kernel(out, tokens, rows, weights)
    assert torch.equal(out, start.index_add_(0, tokens, rows * weights[:, None]))


def test_out_of_range_tokens_are_refused(kernel):
    out = torch.zeros(3, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(out, torch.tensor([0, 3]), torch.ones(2, 4), torch.ones(2))
    assert torch.equal(out, torch.zeros(3, 4))  # checked before anything is written


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_expert_layer_with_and_without_the_kernel(kernel, num_tokens):
    """Top-2 of 4 and top-4 of 8 experts: the layer's output with the native combine equals the torch path's
    (same products, the choices summed in another order: float32 rounding apart)."""
    gen = torch.Generator().manual_seed(num_tokens)
    for num_experts, top_k in ((4, 2), (8, 4)):
        experts = gpt_oss.Experts(16, 24, num_experts, alpha=1.702, limit=7.0)
        for param in experts.parameters():
            param.data = torch.randn(param.shape, generator=gen) * 0.3
        x = torch.randn(num_tokens, 16, generator=gen)
        chosen = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        weights = torch.rand(num_tokens, top_k, generator=gen).softmax(-1)
        calls = []
        counted = lambda *args, calls=calls: calls.append(1) or kernel(*args)  # noqa: E731
        with torch.inference_mode():
            with mock.patch.object(gpt_oss, "add_weighted_rows_kernel", lambda counted=counted: counted):
                native = experts(x, chosen, weights)
            with mock.patch.object(gpt_oss, "add_weighted_rows_kernel", lambda: None):
                torch_path = experts(x, chosen, weights)
        torch.testing.assert_close(native, torch_path, rtol=1e-6, atol=1e-6)
        assert calls  # one call per chunk of experts
