"""engine.gpu's torch references (what a CUDA graph captures where Triton is missing) against the
written-out float64 softmax, with NaN in every page slot they must not read, and the K/V write."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu import default_num_splits
from engine.gpu.reference import reference_decode_attention, reference_write_kv
from tests.engine.gpu.decode_cases import LAYERS, expected_after_write, expected_output, make_case, write_case


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 4), st.integers(0, 40)), min_size=1, max_size=4),
       block_size=st.sampled_from([4, 8, 16]), window=st.sampled_from([None, 1, 3, 10, 100]),
       heads=st.sampled_from([(1, 1), (2, 1), (2, 3), (1, 4)]), head_dim=st.sampled_from([4, 16]),
       with_sinks=st.booleans(), layer=st.integers(0, LAYERS - 1), num_padded=st.integers(0, 2),
       stale_pages=st.booleans(), seed=st.integers(0, 10_000))
def test_reference_attends_exactly_each_tokens_window(lens, block_size, window, heads, head_dim, with_sinks, layer,
                                                      num_padded, stale_pages, seed):
    lens = [(q, q + extra) for q, extra in lens]
    case = make_case(lens, block_size, window, *heads, head_dim, LAYERS, layer, num_padded, stale_pages, seed)
    scale = head_dim ** -0.5
    sinks = case.sinks if with_sinks else None
    out = torch.full_like(case.query, 7.0)
    returned = reference_decode_attention(case.query, case.kv_cache, layer, case.block_tables, case.table_rows,
                                          case.positions, window=window, scale=scale, sinks=sinks, out=out)
    assert returned is out
    torch.testing.assert_close(out.double(), expected_output(case, scale, with_sinks), rtol=1e-5, atol=1e-5)


def test_reference_in_bf16_rounds_like_its_inputs():
    case = make_case([(1, 37), (3, 20)], 8, None, 2, 2, 16, LAYERS, 1, 1, False, seed=3, dtype=torch.bfloat16)
    out = reference_decode_attention(case.query, case.kv_cache, 1, case.block_tables, case.table_rows,
                                     case.positions, window=None, scale=0.25, sinks=case.sinks)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_output(case, 0.25, True), rtol=2e-2, atol=2e-2)


@settings(max_examples=40, deadline=None)
@given(num_tokens=st.integers(1, 12), block_size=st.sampled_from([1, 4, 16]), layer=st.integers(0, LAYERS - 1),
       seed=st.integers(0, 10_000))
def test_reference_write_changes_exactly_the_live_slots(num_tokens, block_size, layer, seed):
    cache, slot_mapping, key, value = write_case(num_tokens, block_size, num_tokens + 1, seed)
    expected = expected_after_write(cache, layer, slot_mapping, key, value)
    reference_write_kv(cache, layer, slot_mapping, key, value)
    assert torch.equal(cache, expected)


def test_reference_write_of_only_padded_rows_changes_nothing():
    cache, _, key, value = write_case(3, 4, 2, seed=5)
    before = cache.clone()
    reference_write_kv(cache, 0, torch.full((3,), -1), key, value)
    assert torch.equal(cache, before)


@settings(max_examples=50, deadline=None)
@given(num_tokens=st.integers(1, 512), num_kv=st.sampled_from([1, 2, 8]), context=st.integers(1, 1 << 17),
       num_sms=st.sampled_from([78, 132]))
def test_splits_only_fill_an_idle_gpu_with_long_ranges(num_tokens, num_kv, context, num_sms):
    splits = default_num_splits(num_tokens, num_kv, context, num_sms)
    assert 1 <= splits <= 32
    if num_tokens * num_kv >= num_sms or context < 1024:
        assert splits == 1  # the grid already fills the GPU, or too few keys to share
    assert splits == 1 or context // splits >= 512  # each split keeps enough keys to pay for its partial write
    assert splits == 1 or num_tokens * num_kv * (splits - 1) < 2 * num_sms  # no more programs than ~2 waves


def test_the_references_read_no_value_on_the_host():
    """What a CUDA graph's capture needs of them: no .item(), no data-dependent shape. On meta tensors
    (shapes, no data) any host read raises; indexing by a 0-dim tensor (``rows[first_live]``, the write's
    first version) was one."""
    cache, slot_mapping, key, value = write_case(5, 4, 6, seed=1)
    meta = [t.to("meta") for t in (cache, slot_mapping, key, value)]
    reference_write_kv(meta[0], 1, *meta[1:])
    case = make_case([(1, 9), (2, 5)], 4, 3, 2, 1, 16, LAYERS, 1, 1, False, seed=2)
    out = reference_decode_attention(*(t.to("meta") for t in (case.query, case.kv_cache)), 1,
                                     *(t.to("meta") for t in (case.block_tables, case.table_rows, case.positions)),
                                     window=3, scale=0.25, sinks=case.sinks.to("meta"))
    assert out.device.type == "meta" and out.shape == case.query.shape
