"""The index tensors attention is built from: positions, KV write rows, buckets (masks, pages, outputs),
checked against their definitions position by position for random batches."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import build_group_attention
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
@given(lens=st.lists(st.tuples(st.integers(1, 12), st.integers(0, 60)), min_size=1, max_size=6),
       block_size=st.sampled_from([1, 2, 4, 16]), window=st.sampled_from([None, 1, 3, 8, 20]),
       pages_seed=st.integers(0, 1000))
def test_group_attention_indexes_the_right_pages_and_positions(lens, block_size, window, pages_seed):
    batch = _batch(lens, block_size, window, pages_seed)
    meta = build_group_attention(batch, "g", window, "cpu")
    page_rows, tables = 2 * LAYERS, batch.block_tables["g"]
    offsets = [sum(batch.query_lens[:r]) for r in range(batch.num_requests)]
    # every new token's K goes to slot p % B of page table[p // B] (layer 0's K row)
    expected_writes = [tables[r][p // block_size] * page_rows * block_size + p % block_size
                       for r in range(batch.num_requests)
                       for p in range(batch.seq_lens[r] - batch.query_lens[r], batch.seq_lens[r])]
    assert meta.write_rows.tolist() == expected_writes
    seen_tokens = []
    for bucket in meta.buckets:
        num_rows, num_queries = bucket.query_rows.shape
        key_len = bucket.mask.shape[2]
        blocks = key_len // block_size
        dead = set(bucket.dead_keys.tolist())
        for i in range(num_rows):
            query_rows = bucket.query_rows[i].tolist()
            r = max(r for r in range(batch.num_requests) if offsets[r] <= query_rows[0])  # the row's request
            q_len, s_len = batch.query_lens[r], batch.seq_lens[r]
            first = 0 if window is None else max(0, s_len - q_len - window + 1) // block_size
            num_blocks = (s_len - 1) // block_size + 1 - first
            pages = bucket.block_rows[i * blocks:(i + 1) * blocks].tolist()
            assert pages == [tables[r][first + min(b, num_blocks - 1)] * page_rows for b in range(blocks)]
            for j in range(num_queries):
                assert query_rows[j] == offsets[r] + min(j, q_len - 1)  # padding repeats the last query
                q_pos = s_len - q_len + min(j, q_len - 1)
                for c in range(key_len):
                    k_pos = first * block_size + c
                    attends = k_pos <= q_pos and (window is None or k_pos > q_pos - window)
                    assert bool(bucket.mask[i, j, c]) == attends, (r, j, c)
            for c in range(key_len):
                assert (i * key_len + c in dead) == (not bucket.mask[i, :, c].any())
        seen_tokens += bucket.out_tokens.tolist()
        assert bucket.query_rows.flatten()[bucket.out_rows].tolist() == bucket.out_tokens.tolist()
    assert sorted(seen_tokens) == list(range(batch.num_tokens))  # every real query attended once


def test_an_unbound_ordinal_inside_the_window_raises():
    batch = _batch([(1, 20)], block_size=4, window=8, pages_seed=0)
    batch.block_tables["g"][0][3] = -1  # positions 12..15: inside the window of position 20
    with pytest.raises(ValueError, match="unbound"):
        build_group_attention(batch, "g", 8, "cpu")
