"""The native kernels on GGUF quantized blocks (engine/native/quant.cpp, quant_gemv.cpp) against the gguf
package's own quantizer and dequantizer: rows dequantize to its float32 values bit for bit; the few-row and
the tiled matmuls equal the float64 product of those values within float32 rounding; a row's result does
not depend on the rest of its batch; NaN and Inf in the activations land where the reference puts them."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.models import packed
from engine.models.quantized import QuantizedWeight
from engine.native import quant_linear_kernel, quant_matmul_kernel, quant_rows_kernel, set_pool_yields_kernel
from tests.engine.engine_fixtures import built_kernel

KINDS = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1]


@pytest.fixture(scope="module")
def kernels():
    return built_kernel(quant_linear_kernel), built_kernel(quant_matmul_kernel), built_kernel(quant_rows_kernel)


def quantized(out_features: int, in_features: int, kind, gen: torch.Generator):
    """(blocks uint8 [out, bytes], their float32 dequantization [out, in]) by the gguf package."""
    dense = torch.randn(out_features, in_features, generator=gen).numpy()
    blocks = quants.quantize(dense, kind)
    return torch.from_numpy(blocks.copy()), torch.from_numpy(quants.dequantize(blocks, kind).copy())


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


shapes = dict(rows=st.integers(1, 11), out_features=st.integers(1, 200), in_blocks=st.integers(1, 12),
              kind=st.sampled_from(KINDS), bias=st.booleans(), seed=st.integers(0, 10_000))


@settings(max_examples=60, deadline=None)
@given(**shapes)
def test_few_rows_equal_the_dequantized_product_whatever_else_is_in_the_batch(kernels, rows, out_features,
                                                                             in_blocks, kind, bias, seed):
    """quant_linear within float32 rounding of the float64 product of gguf's dequantized weights; each row
    bit-identical to that row computed alone (groups of three rows, tiles of weight rows included)."""
    linear, _, _ = kernels
    gen = torch.Generator().manual_seed(seed)
    blocks, weight = quantized(out_features, 32 * in_blocks, kind, gen)
    x = torch.randn(rows, 32 * in_blocks, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = linear(x, blocks, int(kind), b)
    torch.testing.assert_close(y.double(), reference(x, weight, b), rtol=1e-5, atol=2e-6 * 32 * in_blocks)
    for row in range(rows):
        assert torch.equal(linear(x[row:row + 1], blocks, int(kind), b)[0], y[row])


@settings(max_examples=30, deadline=None)
@given(**shapes, tile_rows=st.integers(1, 64))
def test_tiled_matmul_and_rows_equal_the_dequantized_weights(kernels, rows, out_features, in_blocks, kind, bias,
                                                            seed, tile_rows):
    _, matmul, dequantize = kernels
    gen = torch.Generator().manual_seed(seed)
    blocks, weight = quantized(out_features, 32 * in_blocks, kind, gen)
    index = torch.randint(0, out_features, (rows,), generator=gen)
    assert torch.equal(dequantize(blocks, int(kind), index), weight[index])
    x = torch.randn(rows, 32 * in_blocks, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = matmul(x, blocks, int(kind), b, tile_rows, False)
    torch.testing.assert_close(y.double(), reference(x, weight, b), rtol=1e-5, atol=2e-6 * 32 * in_blocks)


@settings(max_examples=30, deadline=None)
@given(**shapes, tile_rows=st.integers(1, 64))
def test_bf16_tiled_matmul_is_the_bf16_product_of_the_dequantized_weights(kernels, rows, out_features, in_blocks,
                                                                          kind, bias, seed, tile_rows):
    """``bf16``: x and the dequantized weights rounded to bf16, their products summed in float32, the sum
    rounded to bf16, then the float32 bias: every output within one bf16 rounding of the float64 product of
    the rounded operands, and (without a bias) itself a bf16 value, so the bf16 path is the one taken."""
    _, matmul, _ = kernels
    gen = torch.Generator().manual_seed(seed)
    blocks, weight = quantized(out_features, 32 * in_blocks, kind, gen)
    x = torch.randn(rows, 32 * in_blocks, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    y = matmul(x, blocks, int(kind), b, tile_rows, True)
    product = reference(x.bfloat16().float(), weight.bfloat16().float(), None)
    got = y.double() - (0 if b is None else b.double())
    torch.testing.assert_close(got, product, rtol=2 ** -8, atol=1e-5 * 32 * in_blocks)
    if b is None:
        assert torch.equal(y.bfloat16().float(), y)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 8), in_blocks=st.integers(1, 4), seed=st.integers(0, 999),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_nan_and_inf_in_activations_stay_in_their_row(kernels, kind, rows, in_blocks, seed, value):
    """One non-finite activation makes its row's outputs non-finite exactly where the float64 reference's are
    (NaN where the reference is NaN; Q4_1's offset, applied through the block's sum of activations, may turn a
    reference's +-Inf into NaN); the other rows stay finite and correct."""
    linear, matmul, _ = kernels
    gen = torch.Generator().manual_seed(seed)
    blocks, weight = quantized(40, 32 * in_blocks, kind, gen)
    x = torch.randn(rows, 32 * in_blocks, generator=gen)
    bad_row, bad_col = seed % rows, seed % (32 * in_blocks)
    x[bad_row, bad_col] = value
    want = reference(x, weight, None)
    for y in (linear(x, blocks, int(kind), None), matmul(x, blocks, int(kind), None, 16, False)):
        assert torch.equal(y.isfinite(), want.isfinite())
        assert y[want.isnan()].isnan().all()
        if kind != GGMLQuantizationType.Q4_1:
            torch.testing.assert_close(y[bad_row].double(), want[bad_row], equal_nan=True)
        good = torch.arange(rows) != bad_row
        torch.testing.assert_close(y[good].double(), want[good], rtol=1e-5, atol=1e-4)


def test_bad_inputs_are_refused(kernels):
    linear, matmul, dequantize = kernels
    blocks = torch.zeros(4, 40, dtype=torch.uint8)  # two Q4_1 blocks a row: in = 64
    with pytest.raises(RuntimeError, match="in = 64"):
        linear(torch.ones(2, 32), blocks, 3, None)
    with pytest.raises(RuntimeError, match="unsupported kind 10"):  # Q2_K
        linear(torch.ones(2, 64), blocks, 10, None)
    with pytest.raises(RuntimeError, match="not whole blocks of 34"):
        linear(torch.ones(2, 64), blocks, 8, None)
    with pytest.raises(RuntimeError, match="bias"):
        matmul(torch.ones(2, 64), blocks, 3, torch.ones(5), 2, False)
    with pytest.raises(RuntimeError, match="out of range"):
        dequantize(blocks, 3, torch.tensor([4]))


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_linear_sends_a_quantized_weight_to_its_kernels(kernels, rows):
    """packed.linear: up to NATIVE_MAX_ROWS rows to quant_linear, more to the tiled GEMM; the same values."""
    blocks, weight = quantized(300, 96, GGMLQuantizationType.Q4_1, torch.Generator().manual_seed(rows))
    x, bias = torch.randn(rows, 96), torch.randn(300)
    y = packed.linear(x, QuantizedWeight(blocks, int(GGMLQuantizationType.Q4_1)), bias, None)
    few = kernels[0](x, blocks, 3, bias)
    assert torch.equal(y, few) == (rows <= packed.NATIVE_MAX_ROWS)
    torch.testing.assert_close(y, few, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y.double(), reference(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 8, 9, 40])
def test_a_bf16_prefill_weight_rounds_only_its_many_row_matmuls(kernels, rows):
    """prefill_dtype bfloat16: up to NATIVE_MAX_ROWS rows the float32 few-row kernel, bit for bit; more
    rows the tiled GEMM in bf16, within bf16 rounding of the float32 result."""
    blocks, weight = quantized(300, 96, GGMLQuantizationType.Q4_1, torch.Generator().manual_seed(rows))
    x = torch.randn(rows, 96)
    y = packed.linear(x, QuantizedWeight(blocks, int(GGMLQuantizationType.Q4_1), torch.bfloat16), None, None)
    few = kernels[0](x, blocks, 3, None)
    if rows <= packed.NATIVE_MAX_ROWS:
        assert torch.equal(y, few)
    else:
        assert torch.equal(y.bfloat16().float(), y) and not torch.equal(y, few)
        torch.testing.assert_close(y, few, rtol=2e-2, atol=2e-2 * 96 ** 0.5)  # |y| ~ sqrt(in)
    with pytest.raises(ValueError, match="prefill_dtype must be float32 or bfloat16"):
        QuantizedWeight(blocks, int(GGMLQuantizationType.Q4_1), torch.float16)


def test_quantized_weight_rows_split_and_cat(kernels):
    blocks, weight = quantized(70, 64, GGMLQuantizationType.Q8_0, torch.Generator().manual_seed(1))
    qw = QuantizedWeight(blocks, int(GGMLQuantizationType.Q8_0))
    assert qw.shape == (70, 64) and torch.equal(qw.dequantize(), weight)
    parts = qw.split([30, 10, 30])
    assert [tuple(p.shape) for p in parts] == [(30, 64), (10, 64), (30, 64)]
    assert torch.equal(parts[1].dequantize(), weight[30:40])
    assert torch.equal(QuantizedWeight.cat(parts[::-1]).dequantize(), torch.cat([weight[40:], weight[30:40],
                                                                                 weight[:30]]))
    with pytest.raises(ValueError, match="not Q4_0 blocks"):
        QuantizedWeight(blocks, int(GGMLQuantizationType.Q4_0))
    bf16_parts = QuantizedWeight(blocks, int(GGMLQuantizationType.Q8_0), torch.bfloat16).split([30, 40])
    assert [p.prefill_dtype for p in bf16_parts] == [torch.bfloat16] * 2
    assert QuantizedWeight.cat(bf16_parts).prefill_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="different kinds or prefill dtypes"):
        QuantizedWeight.cat([parts[0], bf16_parts[1]])
    assert np.isclose(qw.nbytes / weight.numel(), 34 / 32)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 8), out_features=st.integers(1, 3000), in_blocks=st.integers(1, 24),
       kind=st.sampled_from(KINDS), seed=st.integers(0, 10_000))
def test_few_rows_are_the_same_on_any_number_of_threads(kernels, rows, out_features, in_blocks, kind, seed):
    """The few-row kernel's outputs are cut into chunks that any thread of engine/native/work_pool.cpp
    claims: 1, 2 or 3 threads (more than this box's cores) give the same bits, call after call, whether
    the pool's helpers pause or yield between jobs (set_pool_yields)."""
    linear, _, _ = kernels
    set_pool_yields = set_pool_yields_kernel()
    gen = torch.Generator().manual_seed(seed)
    blocks, _ = quantized(out_features, 32 * in_blocks, kind, gen)
    x = torch.randn(rows, 32 * in_blocks, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = linear(x, blocks, int(kind), None)
        for threads in (2, 3):
            torch.set_num_threads(threads)
            for yields in (False, True, False):
                set_pool_yields(yields)
                assert torch.equal(linear(x, blocks, int(kind), None), want)
    finally:
        torch.set_num_threads(before)
        set_pool_yields(False)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names from /proc")
def test_the_pools_helper_threads_carry_its_name(kernels):
    """Once a few-row call ran on 3 threads, the pool's 2 helpers exist and the OS knows them as
    windserve-pool (what bench.serve_threads and `top -H` show), and no other thread took that name."""
    linear, _, _ = kernels
    gen = torch.Generator().manual_seed(0)
    blocks, _ = quantized(3000, 32 * 8, GGMLQuantizationType.Q8_0, gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        linear(torch.randn(2, 32 * 8, generator=gen), blocks, int(GGMLQuantizationType.Q8_0), None)
    finally:
        torch.set_num_threads(before)
    names = []
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names.append(comm.read().strip())
    assert names.count("windserve-pool") >= 2
    with open(f"/proc/self/task/{os.getpid()}/comm") as comm:
        assert comm.read().strip() != "windserve-pool"  # the calling (main) thread keeps its own name


def test_a_long_kernel_call_lets_other_python_threads_run(kernels):
    """The matmuls release the GIL: while one runs on a thread (the engine's step thread), the event loop's
    thread keeps executing Python. Iterations of the main thread are stamped; some fall well inside the
    call, which a call holding the GIL would not allow."""
    import threading
    import time

    _, matmul, _ = kernels
    gen = torch.Generator().manual_seed(0)
    blocks, _ = quantized(2048, 32 * 64, GGMLQuantizationType.Q8_0, gen)
    x = torch.randn(4096, 32 * 64, generator=gen)
    span: list[float] = []

    def call():  # one call: between two calls a GIL-holding kernel would let the main thread in
        span.append(time.monotonic())
        matmul(x, blocks, int(GGMLQuantizationType.Q8_0), None, 64, False)
        span.append(time.monotonic())

    worker = threading.Thread(target=call)
    stamps = []
    worker.start()
    while worker.is_alive():
        stamps.append(time.monotonic())
    worker.join()
    start, end = span
    assert end - start > 0.04  # long enough that a GIL held across it would be seen
    inside = [t for t in stamps if start + 0.01 < t < end - 0.01]
    assert len(inside) > 0.5 * len(stamps)  # 0.94 of them; 0.19 when the binding held the GIL
