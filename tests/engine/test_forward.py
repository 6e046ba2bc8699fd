"""The index tensors attention is built from: positions, KV write rows, buckets (masks, pages, outputs),
checked against their definitions position by position for random batches."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import attention_plan
from engine.attention_plan import build_group_attention
from engine.forward import ForwardBatch, positions_of

LAYERS = 2  # layers in the group: a page holds LAYERS * 2 (K, V) rows


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 9), st.integers(0, 40)), min_size=1, max_size=8))
def test_positions_run_from_seq_minus_query_to_seq(lens):
    query_lens, seq_lens = [q for q, _ in lens], [q + extra for q, extra in lens]
    expected = [p for q, s in zip(query_lens, seq_lens) for p in range(s - q, s)]
    positions = positions_of(query_lens, seq_lens)
    assert positions.dtype == torch.long and positions.tolist() == expected


def _batch(lens, block_size, window, pages_seed):
    """Request r: seq_lens / query_lens from ``lens``; distinct random pages for every ordinal the
    window reads or writes, -1 (released) below it."""
    query_lens, seq_lens = [q for q, _ in lens], [q + extra for q, extra in lens]
    gen = torch.Generator().manual_seed(pages_seed)
    num_pages = sum((s - 1) // block_size + 1 for s in seq_lens) + 3
    free = torch.randperm(num_pages, generator=gen).tolist()
    tables = []
    for q, s in zip(query_lens, seq_lens):
        first = 0 if window is None else max(0, s - q - window + 1) // block_size
        tables.append([-1 if b < first else free.pop() for b in range((s - 1) // block_size + 1)])
    kv = torch.zeros(num_pages, LAYERS, 2, block_size, 1, 1)
    return ForwardBatch(input_ids=torch.zeros(sum(query_lens), dtype=torch.long),
                        positions=positions_of(query_lens, seq_lens), query_lens=query_lens, seq_lens=seq_lens,
                        block_tables={"g": tables}, kv_caches={"g": kv}, tokens_per_block=block_size)


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 80), st.integers(0, 60)), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 4, 16]), window=st.sampled_from([None, 1, 3, 8, 20, 40]),
       pages_seed=st.integers(0, 1000), is_native=st.booleans())
def test_group_attention_reads_exactly_each_querys_window(lens, block_size, window, pages_seed, is_native):
    """Whatever the bucketing and tiling: every new token is written to its own slot; every real query
    attends each key position of ``[p - W + 1, p]`` (``[0, p]`` without a window) exactly once, read
    from the page its request's block table holds for it; a key column nobody attends is dead. With
    the native kernel, the requests (or tiles) of at most 8 queries or 256 x 256 queries x keys, and all of
    them in a window of at most 64, are attended in place instead."""
    batch = _batch(lens, block_size, window, pages_seed)
    with _native_kernel(is_native):
        meta = build_group_attention(batch, "g", window, "cpu")
    page_rows, tables, positions = 2 * LAYERS, batch.block_tables["g"], batch.positions.tolist()
    request_of = [r for r, q in enumerate(batch.query_lens) for _ in range(q)]
    expected_writes = [tables[r][p // block_size] * page_rows * block_size + p % block_size
                       for r, p in zip(request_of, positions)]
    assert meta.write_rows.tolist() == expected_writes
    seen_tokens = []
    for bucket in meta.buckets:
        num_rows, num_queries = bucket.query_rows.shape
        # causal: keys are the prefix positions 0..a-1 (a = prefix_len, from pages), then the new tokens
        # query_rows themselves; query j reads the whole prefix and new columns 0..j
        causal, prefix = bucket.mask is None, bucket.prefix_len
        key_len = prefix + num_queries if causal else bucket.mask.shape[2]
        blocks = len(bucket.block_rows) // num_rows
        real = set(bucket.out_rows.tolist())
        dead = set(bucket.dead_keys.tolist())
        assert not causal or (not dead and blocks == -(-prefix // block_size))  # only the prefix's pages
        assert not prefix or num_rows == 1
        for i in range(num_rows):
            r = request_of[int(bucket.query_rows[i, 0])]
            pages = [int(row) // page_rows for row in bucket.block_rows[i * blocks:(i + 1) * blocks]]
            # the position each key column holds: its page's ordinal in r's table and its slot, or the new token's
            from_pages = prefix if causal else key_len
            key_positions = [tables[r].index(pages[c // block_size]) * block_size + c % block_size
                             for c in range(from_pages)]
            key_positions += [positions[int(t)] for t in bucket.query_rows[i]] if causal else []
            for j in range(num_queries):
                token = int(bucket.query_rows[i, j])
                assert request_of[token] == r
                attended = [key_positions[c] for c in range(key_len)
                            if (c < prefix + j + 1 if causal else bucket.mask[i, j, c])]
                if i * num_queries + j in real:
                    p = positions[token]
                    assert sorted(attended) == list(range(0 if window is None else max(0, p - window + 1), p + 1))
            for c in range(key_len if not causal else 0):
                assert (i * key_len + c in dead) == (not bucket.mask[i, :, c].any())
        seen_tokens += bucket.out_tokens.tolist()
        assert bucket.query_rows.flatten()[bucket.out_rows].tolist() == bucket.out_tokens.tolist()
    seen_tokens += _check_in_place(meta.in_place, tables, request_of, positions, block_size, window)
    assert (meta.in_place is not None) <= is_native
    assert sorted(seen_tokens) == list(range(batch.num_tokens))  # every real query attended once


def _check_in_place(in_place, tables, request_of, positions, block_size, window) -> list[int]:
    """The tokens the kernel attends: each unit's queries are consecutive tokens of one request, the
    last Q of positions ``[0, S)``, and its table maps every position a query reads to the page the
    request's block table holds for it."""
    if in_place is None:
        return []
    tokens = []
    for first, num_q, seq, table in zip(in_place.first_rows.tolist(), in_place.query_lens.tolist(),
                                        in_place.seq_lens.tolist(), in_place.tables.tolist()):
        assert 1 <= num_q and (num_q <= 8 or num_q * seq <= 256 * 256 or window is not None and window <= 64)
        r = request_of[first]
        for i in range(num_q):
            token = first + i
            assert request_of[token] == r and positions[token] == seq - num_q + i
            low = 0 if window is None else max(0, positions[token] - window + 1)
            assert all(table[p // block_size] == tables[r][p // block_size] >= 0
                       for p in range(low, positions[token] + 1))
            tokens.append(token)
    return tokens


@contextlib.contextmanager
def _native_kernel(is_on: bool):
    """The plan as it is built with and without the native kernel (whether or not this machine built it)."""
    with mock.patch.object(attention_plan, "paged_decode_kernel", lambda: (lambda *args: None) if is_on else None):
        yield


def test_a_long_chunk_of_a_sliding_window_layer_is_read_in_tiles():
    """100 new tokens of a fresh prompt, window 32: tiles of 32 queries. The first is causal over its
    own new tokens (no page read); the others each read their own window's keys only. The torch path:
    with the native kernel, requests this short are attended in place."""
    with _native_kernel(False):
        _check_tiles_and_kinds()


def _check_tiles_and_kinds():
    batch = _batch([(100, 0)], block_size=16, window=32, pages_seed=0)
    meta = build_group_attention(batch, "g", 32, "cpu")
    causal = [b for b in meta.buckets if b.mask is None]
    paged = [b for b in meta.buckets if b.mask is not None]
    assert [b.query_rows.tolist() for b in causal] == [[list(range(32))]]
    assert sum(b.query_rows.shape[0] for b in paged) == 3  # tiles of 32, 32, 4 queries
    assert sorted(t for b in paged for t in b.out_tokens.tolist()) == list(range(32, 100))
    assert max(b.mask.shape[2] for b in paged) <= 32 + 32 + 16  # a tile's window, block-aligned; not 112
    full = build_group_attention(batch, "g", None, "cpu")
    assert [(b.mask, b.query_rows.tolist()) for b in full.buckets] == [(None, [list(range(100))])]
    batch = _batch([(100, 7), (30, 7)], block_size=16, window=None, pages_seed=0)  # after 7 cached tokens
    full = build_group_attention(batch, "g", None, "cpu")
    masked, split = full.buckets
    assert masked.mask.shape == (1, 30, 48)  # a short chunk: one masked read of all its keys, from pages
    assert (split.mask, split.prefix_len, split.query_rows.tolist()) == (None, 7, [list(range(100))])
    assert len(split.block_rows) == 1  # the prefix's one page; the 100 new keys are the step's own


@pytest.mark.parametrize("is_native", [False, True])
def test_an_unbound_ordinal_inside_the_window_raises(is_native):
    batch = _batch([(1, 20)], block_size=4, window=8, pages_seed=0)
    batch.block_tables["g"][0][3] = -1  # positions 12..15: inside the window of position 20
    with _native_kernel(is_native), pytest.raises(ValueError, match="unbound"):
        build_group_attention(batch, "g", 8, "cpu")


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 200)), min_size=1, max_size=8),
       block_size=st.sampled_from([1, 4, 16]), window=st.sampled_from([None, 1, 8, 20, 128]),
       pages_seed=st.integers(0, 1000))
def test_a_decode_step_is_planned_as_the_general_path_plans_it(lens, block_size, window, pages_seed):
    """Requests of at most 8 new queries (decode, verify) take the plain-Python builder; the general path,
    which attends these short requests in place too (queries x keys <= 256 x 256), builds the same tensors."""
    batch = _batch(lens, block_size, window, pages_seed)
    with _native_kernel(True):
        fast = build_group_attention(batch, "g", window, "cpu")
        with mock.patch.object(attention_plan, "_MAX_IN_PLACE_QUERIES", 0):  # not a decode step: the general path
            general = build_group_attention(batch, "g", window, "cpu")
    assert fast.buckets == general.buckets == ()
    assert torch.equal(fast.write_rows, general.write_rows)
    for name in ("first_rows", "query_lens", "seq_lens", "tables"):
        assert torch.equal(getattr(fast.in_place, name), getattr(general.in_place, name)), name


def test_a_decode_write_to_an_unbound_ordinal_raises():
    batch = _batch([(1, 20), (2, 3)], block_size=4, window=None, pages_seed=0)
    batch.block_tables["g"][1][1] = -1  # request 1 writes position 4: block 1
    with _native_kernel(True), pytest.raises(ValueError, match="a KV write .*unbound"):
        build_group_attention(batch, "g", None, "cpu")
