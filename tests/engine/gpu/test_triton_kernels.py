"""engine.gpu's Triton kernels against the written-out float64 softmax, with NaN in every page slot they
must not read: unbound and stale pages, slots past a token's position or before its window, other
layers, a table row nobody uses. Without a GPU (CI) under Triton's interpreter on CPU tensors
(conftest.py sets TRITON_INTERPRET=1); on a GPU machine compiled, on CUDA tensors."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gpu import paged_attention, paged_decode_attention, write_kv
from engine.gpu.triton_build import is_interpreted
from tests.engine.gpu.decode_cases import LAYERS, expected_after_write, expected_output, make_case, write_case

CASES = dict(lens=st.lists(st.tuples(st.integers(1, 3), st.integers(0, 30)), min_size=1, max_size=3),
             block_size=st.sampled_from([4, 8, 16]), window=st.sampled_from([None, 1, 3, 10, 100]),
             heads=st.sampled_from([(1, 1), (2, 1), (2, 3), (1, 4)]), head_dim=st.sampled_from([4, 16]),
             with_sinks=st.booleans(), layer=st.integers(0, LAYERS - 1), num_padded=st.integers(0, 2),
             stale_pages=st.booleans(), seed=st.integers(0, 10_000))


DEVICE = "cpu" if is_interpreted() else "cuda"


def _attend(case, with_sinks, num_splits, fill=None):
    """The kernel's output for ``case`` (built on the CPU), run on DEVICE, as a CPU tensor. With ``fill``:
    into a preallocated ``out`` holding that value, which must be the tensor returned."""
    moved = [t.to(DEVICE) for t in (case.query, case.kv_cache, case.block_tables, case.table_rows, case.positions,
                                    case.sinks)]
    out = None if fill is None else torch.full_like(moved[0], fill)
    result = paged_decode_attention(*moved[:2], case.layer, *moved[2:5], window=case.window,
                                    scale=case.query.shape[2] ** -0.5, sinks=moved[5] if with_sinks else None,
                                    out=out, num_splits=num_splits)
    assert out is None or result is out
    return result.cpu()


@settings(max_examples=25, deadline=None)
@given(**CASES, num_splits=st.sampled_from([1, 3]), int32_positions=st.booleans())
def test_kernel_attends_exactly_each_tokens_window(lens, block_size, window, heads, head_dim, with_sinks, layer,
                                                   num_padded, stale_pages, seed, num_splits, int32_positions):
    """Decode steps (1 new token) and verify steps (several, consecutive positions, one table row)."""
    lens = [(q, q + extra) for q, extra in lens]
    case = make_case(lens, block_size, window, *heads, head_dim, LAYERS, layer, num_padded, stale_pages, seed)
    if int32_positions:
        case.positions = case.positions.int()
    out = _attend(case, with_sinks, num_splits, fill=7.0)
    expected = expected_output(case, head_dim ** -0.5, with_sinks)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)  # NaN anywhere fails too


@settings(max_examples=10, deadline=None)
@given(**CASES, num_splits=st.integers(2, 5))
def test_splits_equal_one_split(lens, block_size, window, heads, head_dim, with_sinks, layer, num_padded,
                                stale_pages, seed, num_splits):
    lens = [(q, q + extra) for q, extra in lens]
    case = make_case(lens, block_size, window, *heads, head_dim, LAYERS, layer, num_padded, stale_pages, seed)
    torch.testing.assert_close(_attend(case, with_sinks, num_splits), _attend(case, with_sinks, 1),
                               rtol=1e-6, atol=1e-6)


def test_bf16_pages_and_queries_round_like_their_inputs():
    case = make_case([(1, 37), (3, 20)], 8, 16, 2, 2, 16, LAYERS, 1, 1, False, seed=3, dtype=torch.bfloat16)
    out = _attend(case, True, 2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_output(case, 16 ** -0.5, True), rtol=2e-2, atol=2e-2)


def test_strided_queries_of_a_fused_projection():
    """The decoder's q is a view of the fused q/k/v rows: a token stride of (Hq + 2 Hkv) D."""
    case = make_case([(2, 21)], 4, None, 2, 2, 16, LAYERS, 0, 1, False, seed=7)
    fused = torch.cat([case.query, torch.randn(case.query.shape[0], 4, 16)], dim=1)
    dense = _attend(case, False, 1)
    case.query = fused[:, :4]
    assert torch.equal(_attend(case, False, 1), dense)


def test_the_kernels_are_what_ran():
    """DEVICE's tensors take the Triton path here, not the torch reference."""
    assert paged_attention._runs_triton(torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE))


@settings(max_examples=15, deadline=None)
@given(num_tokens=st.integers(1, 10), block_size=st.sampled_from([1, 4, 16]), layer=st.integers(0, LAYERS - 1),
       seed=st.integers(0, 10_000))
def test_write_changes_exactly_the_live_slots(num_tokens, block_size, layer, seed):
    cache, slot_mapping, key, value = write_case(num_tokens, block_size, num_tokens + 1, seed)
    expected = expected_after_write(cache, layer, slot_mapping, key, value)
    pages = cache.to(DEVICE)
    write_kv(pages, layer, slot_mapping.to(DEVICE), key.to(DEVICE), value.to(DEVICE))
    assert torch.equal(pages.cpu(), expected)


def test_write_of_only_padded_rows_changes_nothing_and_bf16_pages_round():
    cache, _, key, value = write_case(3, 4, 2, seed=5)
    key, value = key.to(DEVICE), value.to(DEVICE)
    pages = cache.to(DEVICE)
    write_kv(pages, 1, torch.full((3,), -1, device=DEVICE), key, value)
    assert torch.equal(pages.cpu(), cache)
    pages = cache.bfloat16().to(DEVICE)
    slot_mapping = torch.tensor([5, -1, 2])
    write_kv(pages, 1, slot_mapping.to(DEVICE), key, value)  # float32 rows into bf16 pages: rounded as torch does
    assert torch.equal(pages.cpu(), expected_after_write(cache, 1, slot_mapping, key.cpu(), value.cpu()).bfloat16())
