"""The native K/V write (engine/native/kv_write.cpp): the same pages as paged_attention's two index_copy_,
every other slot untouched."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.native import write_kv_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(write_kv_kernel)


@settings(max_examples=60, deadline=None)
@given(num_pages=st.integers(1, 6), num_layers=st.integers(1, 3), block=st.sampled_from([1, 4, 16]),
       kv_heads=st.integers(1, 3), head_dim=st.sampled_from([4, 32]), num_tokens=st.integers(1, 10),
       seed=st.integers(0, 10_000))
def test_same_slots_as_index_copy(kernel, num_pages, num_layers, block, kv_heads, head_dim, num_tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = int(torch.randint(0, num_layers, (1,), generator=gen))
    cache = torch.randn(num_pages, num_layers, 2, block, kv_heads, head_dim, generator=gen)
    # distinct (page, slot) targets, as a step writes them; rows of layer 0's K in the flat token-row view
    slots = torch.randperm(num_pages * block, generator=gen)[:num_tokens]
    write_rows = (slots // block) * (num_layers * 2 * block) + slots % block
    n = len(write_rows)
    qkv = torch.randn(n, 3 + 2 * kv_heads, head_dim, generator=gen)  # strided views, as the fused q/k/v gives
    key, value = qkv[:, 3:3 + kv_heads], qkv[:, 3 + kv_heads:]
    want = cache.clone()
    rows = want.view(-1, kv_heads * head_dim)
    rows.index_copy_(0, write_rows + 2 * layer * block, key.reshape(n, -1))
    rows.index_copy_(0, write_rows + (2 * layer + 1) * block, value.reshape(n, -1))
    kernel(cache, layer, write_rows, key, value)
    assert torch.equal(cache, want)


def test_out_of_range_rows_and_bad_layouts_are_refused(kernel):
    cache = torch.zeros(2, 1, 2, 4, 1, 8)
    key = value = torch.ones(1, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(cache, 0, torch.tensor([16]), key, value)  # a third page of two
    with pytest.raises(RuntimeError, match="out of range"):
        kernel(cache, 1, torch.tensor([0]), key, value)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernel(cache, 0, torch.tensor([0]), torch.ones(1, 8, 1).transpose(1, 2), value)
    assert not cache.any()  # nothing written by a refused call
