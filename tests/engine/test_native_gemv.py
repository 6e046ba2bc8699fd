"""The native few-row matmul (engine/native/gemv.cpp) against a float64 reference, row by row, and the
routing in engine.models.packed.linear that sends a decode step's matmuls to it."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import packed
from engine.native import rows_linear_kernel
from tests.engine.engine_fixtures import built_kernel


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(rows_linear_kernel)


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 11), out_features=st.integers(1, 300), in_features=st.integers(1, 200),
       bias=st.booleans(), seed=st.integers(0, 10_000))
def test_each_row_is_its_float64_product_whatever_else_is_in_the_batch(kernel, rows, out_features, in_features,
                                                                         bias, seed):
    """Sizes off the 64-lane blocks and the 4-row groups included (tails, masked loads); every row's result is
    bit-identical to that row computed alone, and within float32 rounding of the float64 product."""
    gen = torch.Generator().manual_seed(seed)
    x, weight = torch.randn(rows, in_features, generator=gen), torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = kernel(x, weight, b)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6 * in_features)
    for row in range(rows):
        assert torch.equal(kernel(x[row:row + 1], weight, b)[0], y[row])


def test_many_weight_rows_cross_the_blocks_and_reach_every_output(kernel):
    """[1500, 96]: more weight rows than one L2 block holds; a NaN in one weight row lands in that output only."""
    weight = torch.randn(1500, 96)
    weight[1234, 7] = float("nan")
    y = kernel(torch.randn(6, 96), weight, None)
    assert torch.isnan(y[:, 1234]).all() and not torch.isnan(y[:, :1234]).any() and not torch.isnan(y[:, 1235:]).any()


def test_bad_inputs_are_refused(kernel):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(torch.ones(2, 8), torch.ones(8, 4).t(), None)  # weight stored [in, out]
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(torch.ones(2, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.float64), None)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kernel(torch.ones(2, 7), torch.ones(4, 8), None)
    with pytest.raises(RuntimeError, match="bias"):
        kernel(torch.ones(2, 8), torch.ones(4, 8), torch.ones(5))


@pytest.mark.parametrize("rows", [1, 5, 8, 9, 32])
def test_linear_sends_up_to_eight_rows_to_the_kernel(kernel, rows):
    """packed.linear: <= NATIVE_MAX_ROWS rows of an [out, in] float32 weight go to the kernel, more to oneDNN's
    packed weight (or MKL); the same values either way, within float32 rounding."""
    x, weight, bias = torch.randn(rows, 512), torch.randn(1024, 512), torch.randn(1024)
    calls = []
    counted = lambda *args: calls.append(1) or kernel(*args)  # noqa: E731
    pack = packed.pack(weight) if packed.can_pack(weight, 0) else None
    with mock.patch.object(packed, "rows_linear_kernel", lambda: counted):
        y = packed.linear(x, weight, bias, pack)
    assert len(calls) == (1 if rows <= packed.NATIVE_MAX_ROWS else 0)
    torch.testing.assert_close(y, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    with mock.patch.object(packed, "rows_linear_kernel", lambda: counted):
        packed.linear(x, weight.t().contiguous().t(), bias, pack)  # stored [in, out]: not the kernel's layout
    assert len(calls) == (1 if rows <= packed.NATIVE_MAX_ROWS else 0)
