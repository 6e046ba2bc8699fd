"""The native MoE routing (engine/native/route.cpp) against torch's topk / softmax / stable argsort."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import gpt_oss
from engine.native import moe_route_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(moe_route_kernel)


@settings(max_examples=80, deadline=None)
@given(num_tokens=st.integers(1, 60), num_experts=st.integers(1, 32), top_k=st.integers(1, 4),
       seed=st.integers(0, 10_000))
def test_same_pairs_and_weights_as_torch(kernel, num_tokens, num_experts, top_k, seed):
    top_k = min(top_k, num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 4
    tokens, weights, counts = kernel(logits, top_k)
    top, experts = logits.topk(top_k, dim=-1)
    order = experts.flatten().argsort(stable=True)
    assert tokens.tolist() == (order // top_k).tolist()  # each expert's pairs in (token, choice) order
    assert counts.tolist() == torch.bincount(experts.flatten(), minlength=num_experts).tolist()
    torch.testing.assert_close(weights, top.softmax(dim=-1).flatten()[order], rtol=2e-6, atol=1e-7)


def test_ties_go_to_the_lower_expert(kernel):
    tokens, weights, counts = kernel(torch.tensor([[1.0, 3.0, 3.0, 3.0]]), 2)
    assert counts.tolist() == [0, 1, 1, 0] and tokens.tolist() == [0, 0] and weights.tolist() == [0.5, 0.5]


@pytest.mark.parametrize("num_tokens", [1, 9, 300])
def test_moe_layer_with_and_without_the_native_routing(kernel, num_tokens):
    config = mock.Mock(hidden_size=16, num_local_experts=8, num_experts_per_tok=4, intermediate_size=24,
                       swiglu_alpha=1.702, swiglu_limit=7.0)
    mlp = gpt_oss.MoeMLP(config)
    gen = torch.Generator().manual_seed(num_tokens)
    for param in mlp.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.3
    x = torch.randn(num_tokens, 16, generator=gen)
    calls = []
    counted = lambda *args, calls=calls: calls.append(1) or kernel(*args)  # noqa: E731
    with torch.inference_mode():
        with mock.patch.object(gpt_oss, "moe_route_kernel", lambda: counted):
            native = mlp(x)
        with mock.patch.object(gpt_oss, "moe_route_kernel", lambda: None):
            torch_routing = mlp(x)
    assert calls == [1]
    torch.testing.assert_close(native, torch_routing, rtol=1e-5, atol=1e-6)
