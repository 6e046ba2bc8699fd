"""The native expert layer for a decode step's few tokens (engine/native/moe.cpp): the same bits as the
layer's per-expert path (rows_linear, clamped_swiglu, add_weighted_rows), and within float32 rounding of
transformers' formula written out in float64."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import gpt_oss
from engine.native import moe_experts_kernel, moe_route_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(moe_experts_kernel)


def make_experts(hidden: int, inter: int, num_experts: int, seed: int) -> gpt_oss.Experts:
    gen = torch.Generator().manual_seed(seed)
    experts = gpt_oss.Experts(hidden, inter, num_experts, alpha=1.702, limit=7.0)
    for param in experts.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.3
    experts.pack_weights(min_elements=0)  # [experts, out, in] where engine.native is built
    return experts


def reference(experts: gpt_oss.Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor):
    """transformers' GptOssExperts per token, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for j in range(chosen.shape[1]):
            e = int(chosen[n, j])
            gate_up = x[n].double() @ experts.gate_up_proj[e].double() + experts.gate_up_proj_bias[e].double()
            gate, up = gate_up[0::2].clamp(max=7.0), gate_up[1::2].clamp(-7.0, 7.0)
            glu = gate * torch.sigmoid(gate * 1.702)
            down = ((up + 1) * glu) @ experts.down_proj[e].double() + experts.down_proj_bias[e].double()
            out[n] += weights[n, j].double() * down
    return out


@settings(max_examples=30, deadline=None)
@given(num_tokens=st.integers(1, 8), hidden=st.sampled_from([16, 40, 64, 96]), inter=st.sampled_from([8, 24, 70]),
       experts_k=st.sampled_from([(4, 1), (4, 2), (8, 4), (16, 4)]), seed=st.integers(0, 10_000))
def test_same_bits_as_the_per_expert_path(kernel, num_tokens, hidden, inter, experts_k, seed):
    num_experts, top_k = experts_k
    experts = make_experts(hidden, inter, num_experts, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    tokens, row_weights, counts = built_kernel(moe_route_kernel)(logits, top_k)
    with torch.inference_mode():
        fused = experts.forward_few(x, tokens, row_weights, counts)
        assert fused is not None
        per_expert = experts.forward_sorted(x, tokens, row_weights, counts.tolist())
    assert torch.equal(fused, per_expert)
    top_logits, chosen = logits.topk(top_k, dim=-1)
    torch.testing.assert_close(fused.double(), reference(experts, x, chosen, top_logits.softmax(-1)),
                               rtol=1e-4, atol=1e-4)


def test_more_tokens_than_the_few_row_limit_take_the_per_expert_path(kernel):
    experts = make_experts(64, 32, 8, seed=0)
    x = torch.randn(9, 64)
    tokens, row_weights, counts = built_kernel(moe_route_kernel)(torch.randn(9, 8), 2)
    assert experts.forward_few(x, tokens, row_weights, counts) is None
    unpacked = gpt_oss.Experts(64, 32, 8, alpha=1.702, limit=7.0)  # HF's [experts, in, out]: not the layout
    assert unpacked.forward_few(x[:2], tokens[:4] % 2, row_weights[:4], torch.tensor([4] + [0] * 7)) is None


def test_bad_routing_is_refused_before_anything_is_written(kernel):
    experts = make_experts(16, 8, 4, seed=1)
    x = torch.randn(2, 16)
    args = (experts.gate_up_proj.transpose(1, 2), experts.gate_up_proj_bias, experts.down_proj.transpose(1, 2),
            experts.down_proj_bias, 1.702, 7.0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(x, torch.tensor([0, 2]), torch.ones(2), torch.tensor([2, 0, 0, 0]), *args)
    with pytest.raises(RuntimeError, match="add up"):
        kernel(x, torch.tensor([0, 1]), torch.ones(2), torch.tensor([1, 0, 0, 0]), *args)


def test_decode_layer_calls_the_kernel_once(kernel):
    """MoeMLP on 3 tokens: one moe_experts call, and the layer's output equals the per-expert path's."""
    config = mock.Mock(hidden_size=32, num_local_experts=8, num_experts_per_tok=2, intermediate_size=16,
                       swiglu_alpha=1.702, swiglu_limit=7.0)
    mlp = gpt_oss.MoeMLP(config)
    gen = torch.Generator().manual_seed(5)
    for param in mlp.parameters():
        param.data = torch.randn(param.shape, generator=gen) * 0.3
    mlp.experts.pack_weights(min_elements=0)
    x = torch.randn(3, 32, generator=gen)
    calls = []
    counted = lambda *args: calls.append(1) or kernel(*args)  # noqa: E731
    with torch.inference_mode():
        with mock.patch.object(gpt_oss, "moe_experts_kernel", lambda: counted):
            fused = mlp(x)
        with mock.patch.object(gpt_oss, "moe_experts_kernel", lambda: None):
            per_expert = mlp(x)
    assert len(calls) == 1 and torch.equal(fused, per_expert)
