"""argmax.cpp against torch.argmax(dim=-1) on the CPU, the reference greedy decoding used until now: the same
ids for any row count and vocabulary width (the 16-lane body and the scalar tail), with ties, +-Inf, signed
zeros and NaN (torch: the first NaN wins) placed anywhere; and the sampler's greedy path goes through it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.native import argmax_rows_kernel
from engine.sampler import Sampler, greedy_token_ids
from tests.engine.engine_fixtures import built_kernel

SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 3.5]


@pytest.fixture(scope="module")
def argmax_rows():
    return built_kernel(argmax_rows_kernel)


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 9), width=st.integers(1, 300), seed=st.integers(0, 10_000),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.sampled_from(SPECIALS)),
                         max_size=12),
       ties=st.booleans())
def test_the_same_ids_as_torch_argmax(argmax_rows, rows, width, seed, specials, ties):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, width, generator=gen)
    if ties:  # few distinct values: the largest appears several times in a row
        logits = torch.round(logits)
    for row, column, value in specials:
        logits[row % rows, column % width] = value
    want = logits.argmax(dim=-1)
    got = argmax_rows(logits)
    assert got.dtype == torch.long and torch.equal(got, want)


def test_a_long_row_with_its_maximum_and_a_nan_late(argmax_rows):
    """The vectorized body: a 49,152-token row, its maximum repeated at 3 places, then a NaN past them."""
    logits = torch.randn(2, 49152, generator=torch.Generator().manual_seed(1))
    logits[:, [40_000, 40_016, 49_151]] = 100.0
    logits[1, 45_000] = float("nan")
    assert argmax_rows(logits).tolist() == [40_000, 45_000] == logits.argmax(dim=-1).tolist()


def test_the_sampler_takes_it_for_greedy_rows_and_torch_elsewhere(argmax_rows, monkeypatch):
    """Greedy rows get the kernel's ids (a kernel that answers differently shows it ran); a non-float32 or a
    strided input still gets torch's answer."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(2))
    greedy = [SamplingParams(temperature=0.0)] * 3
    assert Sampler().sample(logits, greedy, [None] * 3).token_ids == logits.argmax(dim=-1).tolist()
    monkeypatch.setattr("engine.sampler.argmax_rows_kernel", lambda: (lambda x: torch.full((x.shape[0],), 7)))
    assert Sampler().sample(logits, greedy, [None] * 3).token_ids == [7, 7, 7]
    assert greedy_token_ids(logits.double()) == logits.argmax(dim=-1).tolist()
    assert greedy_token_ids(logits.t().contiguous().t()) == [7, 7, 7]  # a strided view is made contiguous
