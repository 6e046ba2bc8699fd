"""The native paged decode kernel (engine/native/paged_decode.cpp) against the written-out softmax over
exactly the positions each query reads, with every page slot it must not read poisoned with NaN."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams, attention, attention_plan
from engine.native import paged_decode_kernel
from tests.engine.engine_fixtures import built_kernel, make_engine, run_to_completion, tiny_model

LAYERS = 2


@pytest.fixture(scope="module")
def kernel():
    return built_kernel(paged_decode_kernel)


def _case(lens, block_size, window, heads, head_dim, seed):
    """Pages holding request r's positions (the window's, or all) at random page ids; everything else NaN.
    Two extra token rows at the front belong to no request: the kernel must leave them alone."""
    num_kv, group = heads
    gen = torch.Generator().manual_seed(seed)
    tables, num_pages = [], sum((s - 1) // block_size + 1 for _, s in lens) + 2
    free = torch.randperm(num_pages, generator=gen).tolist()
    cache = torch.full((num_pages, LAYERS, 2, block_size, num_kv, head_dim), float("nan"))
    for q, s in lens:
        low = 0 if window is None else max(0, s - q - window + 1)
        table = [-1 if b < low // block_size else free.pop() for b in range((s - 1) // block_size + 1)]
        for p in range(low, s):
            cache[table[p // block_size], :, :, p % block_size] = torch.randn(LAYERS, 2, num_kv, head_dim,
                                                                               generator=gen)
        tables.append(table)
    query = torch.randn(2 + sum(q for q, _ in lens), num_kv * group, head_dim, generator=gen)
    return cache, tables, query, torch.randn(num_kv * group, generator=gen)


def _reference(query, cache, layer, lens, tables, window, scale, sinks, block_size):
    out, row = torch.full_like(query, 7.0, dtype=torch.float64), 2
    group = query.shape[1] // cache.shape[4]
    for (q, s), table in zip(lens, tables):
        for pos in range(s - q, s):
            keys = range(0 if window is None else max(0, pos - window + 1), pos + 1)
            k = torch.stack([cache[table[p // block_size], layer, 0, p % block_size] for p in keys]).double()
            v = torch.stack([cache[table[p // block_size], layer, 1, p % block_size] for p in keys]).double()
            for h in range(query.shape[1]):
                logits = k[:, h // group] @ query[row, h].double() * scale
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h:h + 1].double()])
                out[row, h] = logits.softmax(0)[: len(keys)] @ v[:, h // group]
            row += 1
    return out


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 70)), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 4, 16]), window=st.sampled_from([None, 1, 5, 40]),
       heads=st.sampled_from([(1, 1), (2, 2), (2, 3), (4, 1)]), head_dim=st.sampled_from([8, 32, 40, 64]),
       with_sinks=st.booleans(), layer=st.integers(0, LAYERS - 1), seed=st.integers(0, 10_000))
def test_each_query_attends_exactly_its_window_from_its_pages(kernel, lens, block_size, window, heads, head_dim,
                                                               with_sinks, layer, seed):
    lens = [(q, q + extra) for q, extra in lens]
    cache, tables, query, sinks = _case(lens, block_size, window, heads, head_dim, seed)
    width = max(map(len, tables))
    out = torch.full_like(query, 7.0)
    first_rows = torch.tensor([2 + sum(q for q, _ in lens[:i]) for i in range(len(lens))])
    kernel(query, cache, layer, first_rows, torch.tensor([q for q, _ in lens]), torch.tensor([s for _, s in lens]),
           torch.tensor([t + [-1] * (width - len(t)) for t in tables]), window or 0, head_dim ** -0.5,
           sinks if with_sinks else None, out)
    expected = _reference(query, cache, layer, lens, tables, window, head_dim ** -0.5,
                          sinks if with_sinks else None, block_size)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)  # NaN anywhere fails too


def test_queries_may_be_strided_rows_of_the_fused_projection(kernel):
    """The decoder passes q as a view of the q/k/v rows: [N, Hq, D] with a token stride of (Hq + 2 Hkv) D."""
    lens, block_size = [(1, 30), (3, 9)], 4
    cache, tables, query, sinks = _case(lens, block_size, None, (2, 2), 32, seed=1)
    fused = torch.cat([query, torch.randn(query.shape[0], 4, 32)], dim=1)
    strided = fused[:, :4]
    assert not strided.is_contiguous()
    width = max(map(len, tables))
    args = (torch.tensor([2, 3]), torch.tensor([1, 3]), torch.tensor([30, 9]),
            torch.tensor([t + [-1] * (width - len(t)) for t in tables]), 0, 0.2, sinks)
    out_strided, out_dense = torch.zeros_like(query), torch.zeros_like(query)
    kernel(strided, cache, 1, *args, out_strided)
    kernel(query, cache, 1, *args, out_dense)
    assert torch.equal(out_strided, out_dense)


def test_bad_inputs_are_refused(kernel):
    cache = torch.zeros(4, LAYERS, 2, 4, 2, 8)
    query, out = torch.zeros(3, 4, 8), torch.zeros(3, 4, 8)
    index = (torch.tensor([0]), torch.tensor([1]), torch.tensor([3]), torch.tensor([[0]]))
    with pytest.raises(RuntimeError, match="float32"):
        kernel(query.double(), cache, 0, *index, 0, 1.0, None, out)
    with pytest.raises(RuntimeError, match="index shapes"):
        kernel(query, cache, LAYERS, *index, 0, 1.0, None, out)
    with pytest.raises(RuntimeError, match="sinks"):
        kernel(query, cache, 0, *index, 0, 1.0, torch.zeros(3), out)


@pytest.mark.parametrize("draft_len", [0, 4])
def test_engine_tokens_are_the_same_with_and_without_the_kernel(kernel, tiny_model, draft_len):
    """windserve-tiny, greedy, decode and (with n-gram drafts) verify steps: the kernel's tokens are the
    torch path's, and with it every decode step's queries really are attended in place."""
    prompts = [[(7 * i + 3 * j) % 200 for j in range(n)] for i, n in enumerate([5, 40, 90, 17, 130, 64])]
    prompts += [[1, 2, 3, 4] * 12]  # repeated: drafts get accepted
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    calls = []

    def counted(*args):
        calls.append(args[4].tolist())  # query_lens of the requests (or tiles) in place
        return kernel(*args)

    with mock.patch.object(attention, "paged_decode_kernel", lambda: counted):
        native = run_to_completion(make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len),
                                   prompts, params)
    with mock.patch.object(attention_plan, "paged_decode_kernel", lambda: None):
        torch_path = run_to_completion(make_engine(tiny_model, tokens_per_block=8, max_draft_len=draft_len),
                                       prompts, params)
    assert native == torch_path
    together = [lens for lens in calls if len(lens) == len(prompts) and max(lens) <= 1 + draft_len]
    assert len(together) >= 4 * 3  # every layer of the steps where all 7 decode (or verify) together
    assert any(max(lens) > 1 for lens in together) == (draft_len > 0)  # verify steps run in place too
