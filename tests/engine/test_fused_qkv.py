"""PagedSelfAttention.fuse_qkv: one q/k/v matmul whose weights stay the projections' own parameters."""

from __future__ import annotations

import pytest
import torch

from engine.models.decoder import PagedSelfAttention, fuse_projections
from engine.models.packed import pack_for_cpu
from tests.engine.helpers import load_pair


@pytest.fixture(params=["llama", "gpt_oss"])  # q/k/v with and without biases
def arch(request):
    return request.param


def test_fused_weights_are_the_projections_parameters(arch):
    _, ours, _ = load_pair(arch)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    params_before = sum(p.numel() for p in ours.parameters())
    fuse_projections(ours)
    assert set(ours.state_dict()) == set(before)
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in before.items())
    assert sum(p.numel() for p in ours.parameters()) == params_before  # nothing doubled
    attn = ours.model.layers[0].self_attn
    weight, bias, _ = attn.qkv
    sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
    assert torch.equal(weight, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
    assert attn.k_proj.weight.data_ptr() == weight[sizes[0]:].data_ptr()  # a view, not a copy
    # loading new weights afterwards reaches the fused tensor too
    with torch.no_grad():
        attn.v_proj.weight.fill_(0.5)
    assert torch.equal(weight[sizes[0] + sizes[1]:], torch.full_like(attn.v_proj.weight, 0.5))
    if bias is not None:
        assert torch.equal(bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))


def test_pack_for_cpu_packs_the_fused_weight_not_the_three_projections():
    _, ours, _ = load_pair("llama")
    pack_for_cpu(fuse_projections(ours), min_elements=0)
    attn = ours.model.layers[0].self_attn
    assert attn.qkv[2] is not None  # the fused weight, packed
    assert all(type(p) is torch.nn.Linear for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert type(attn.o_proj) is not torch.nn.Linear  # o_proj packed as before
    assert isinstance(attn, PagedSelfAttention)
