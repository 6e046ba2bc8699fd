"""What paged attention reads over ``kv[group]: [num_pages, num_layers_in_group, 2, B, num_kv_heads, head_dim]``.

Request ``r`` has ``S = seq_lens[r]`` and its first new token at ``a = S - query_lens[r]``.
The keys read, per group window ``W`` (query ``p`` attends ``[p - W + 1, p]``)::

    position     0 ...... a-W+1 ........ a ........ S-1
    full         [-------------------- read ----------]
    sliding              [------------ read ----------]
    ordinals read     (a-W+1)//B  ...   (S-1)//B        each one must be bound (!= -1)

No ordinal below the window's first block is indexed, so a released (-1)
ordinal is never read. Pages are read whole; the slots of a read page that no
query attends (before the window, past ``S - 1``) are zeroed in the gathered
copy and masked, so whatever they hold (even NaN) cannot reach the output.

Everything index-shaped is computed once per forward and group
(:func:`build_group_attention`) and reused by every layer of the group.
On the CPU in float32, a request with at most ``_MAX_IN_PLACE_QUERIES`` new
queries (a decode or verify step) or at most ``_MAX_IN_PLACE_SCORES`` queries x
keys (a short prompt), and every query of a layer whose window is at most
``_MAX_IN_PLACE_WINDOW``, is attended *in place* when the native kernel
is built (``engine.native``): it reads each key of its window from the page
table directly, nothing gathered, no mask (:class:`InPlaceQueries`). The others
are attended in padded *buckets* (``engine.attention_buckets``: decode steps together, a long
prefill chunk on its own) so no layer loops over requests one by one; in a
sliding-window group a long chunk is first cut into tiles of max(W, 32)
queries, each read as a request of its own (:func:`_window_tiles`). Fresh prompts
no wider than the window are *causal* buckets (their keys are the step's own new
K/V rows) and, on the CPU in float32, so is a chunk of at least ``_MIN_SPLIT_QUERIES``
new tokens after a prefix (the prefix read from the pages apart: :func:`_kinds`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention_buckets import (
    AttentionBucket,
    as_tensors,
    bucket_to_device,
    build_causal_bucket,
    build_masked_bucket,
    build_split_bucket,
    plan_buckets_of,
    raise_unbound,
)
from engine.forward import ForwardBatch
from engine.native import paged_decode_kernel

# Fewest queries of a sliding-window tile (see _window_tiles).
_MIN_TILE = 32
# Fewest new tokens of a chunk after a prefix read in two kernel calls (causal + prefix): below
# this the second call's dozen ops cost more than the masked scores they save.
_MIN_SPLIT_QUERIES = 64
# Most new queries of a request the native kernel attends in place: it scores query by query,
# with no blocking, which pays for decode and verify steps, not for prefill chunks.
_MAX_IN_PLACE_QUERIES = 8
# A request (or tile) whose queries x keys are at most this is attended in place too: for short
# prompts the kernel's query-by-query scores beat the flash kernel's call and copies. Whole runs
# (prompts of 16-256 tokens, c = 32), in place vs flash: windserve-tiny 1.06x, gptoss-mid 1.035x,
# SmolLM2-135M 1.03-1.06x, tokens equal.
_MAX_IN_PLACE_SCORES = 256 * 256
# In a sliding-window layer with a window up to this, every query is attended in place (each reads
# W keys at most). Whole runs, kernel vs tiles, alternated: window 32 (windserve-tiny) 1.07x faster,
# window 128 (gptoss-mid) 0.97x.
_MAX_IN_PLACE_WINDOW = 64


@dataclass(frozen=True)
class InPlaceQueries:
    """Requests whose few new queries the native kernel attends straight from the pages.

    Request r's queries are rows ``first_rows[r] ..`` of the step's tokens, at positions
    ``S - Q .. S - 1`` (``Q = query_lens[r]``, ``S = seq_lens[r]``); position p's key is in page
    ``tables[r, p // B]``, slot ``p % B``. Every ordinal a query's window reads is bound (checked).
    A sliding-window tile is a request here too (its ``S`` is the tile's end).
    """

    first_rows: torch.Tensor  # [R]
    query_lens: torch.Tensor  # [R]
    seq_lens: torch.Tensor  # [R]
    tables: torch.Tensor  # [R, width] page ids, -1 where unbound


@dataclass(frozen=True)
class GroupAttention:
    """Per forward and layer group: where the new tokens' K/V go, and what each query reads."""

    window: int | None
    write_rows: torch.Tensor  # [N] (page id * layers_in_group * 2) * B + slot: layer 0's K row in the slot view
    buckets: tuple[AttentionBucket, ...]
    in_place: InPlaceQueries | None = None


def _padded_table(tables: list[list[int]], min_width: int) -> np.ndarray:
    width = max(min_width, max(len(t) for t in tables))
    table = np.full((len(tables), width), -1, dtype=np.int64)
    for row, ordinals in zip(table, tables):
        row[: len(ordinals)] = ordinals
    return table


def _build_in_place(units, query_lens, seq_lens, first_blocks, offsets, table, block_size, group) -> InPlaceQueries:
    rows = np.asarray(units)
    pages, columns = table[rows], np.arange(table.shape[1])[None]
    read = (columns >= first_blocks[rows, None]) & (columns <= (seq_lens[rows, None] - 1) // block_size)
    raise_unbound(pages, read, group, "attention")
    return InPlaceQueries(*as_tensors(offsets[rows], query_lens[rows], seq_lens[rows], pages))


def build_group_attention(
    batch: ForwardBatch, group: str, window: int | None, device: torch.device | str
) -> GroupAttention:
    """Index tensors for one group, built with numpy on the host (a few us per op, where a torch
    op on these small tensors costs 5-10) from the Python lists, then moved: no device sync."""
    block_size = batch.tokens_per_block
    cache = batch.kv_caches[group]
    page_rows = 2 * cache.shape[1]  # K and V rows of every layer in a page
    can_split = cache.dtype == torch.float32 and cache.device.type == "cpu"  # the kernel returns logsumexp
    if can_split and max(batch.query_lens) <= _MAX_IN_PLACE_QUERIES and paged_decode_kernel() is not None:
        return _build_decode(batch, group, window, page_rows)
    seq_lens, query_lens = np.asarray(batch.seq_lens, dtype=np.int64), np.asarray(batch.query_lens, dtype=np.int64)
    query_starts, offsets = seq_lens - query_lens, np.cumsum(query_lens) - query_lens
    table = _padded_table(batch.block_tables[group], int(seq_lens.max() - 1) // block_size + 1)
    # On the CPU ForwardBatch checked that positions equal these; a device tensor would need a sync.
    positions = (batch.positions if batch.positions.device.type == "cpu" else batch.expected_positions()).numpy()
    requests = np.repeat(np.arange(batch.num_requests), query_lens)
    write_pages = table[requests, positions // block_size]
    raise_unbound(write_pages, None, group, "a KV write")
    write_rows = write_pages * page_rows * block_size + positions % block_size
    write_rows = torch.from_numpy(write_rows).to(device)
    if window is None:
        first_blocks = np.zeros_like(query_starts)
    else:
        query_lens, query_starts, offsets, units = _window_tiles(query_lens, query_starts, offsets, window)
        seq_lens, table = query_starts + query_lens, table[units]
        first_blocks = np.maximum(0, query_starts - window + 1) // block_size
    num_blocks = (seq_lens - 1) // block_size + 1 - first_blocks
    per_request = (query_lens, query_starts, seq_lens, first_blocks, num_blocks, offsets)
    is_in_place = _in_place(query_lens, seq_lens, window) & (can_split and paged_decode_kernel() is not None)
    paged, causal, split = (kind[~is_in_place[kind]] for kind in _kinds(query_lens, query_starts, seq_lens,
                                                                          window, can_split))
    buckets = [build_masked_bucket(members, per_request, table, block_size, window, group, page_rows)
               for members in plan_buckets_of(paged, query_lens, num_blocks * block_size)]
    buckets += [build_causal_bucket(members, query_lens, offsets)
                for members in plan_buckets_of(causal, query_lens, query_lens)]
    buckets += [build_split_bucket(r, query_lens, query_starts, offsets, table, block_size, group, page_rows)
                for r in split]
    units = np.flatnonzero(is_in_place)
    in_place = _build_in_place(units, query_lens, seq_lens, first_blocks, offsets, table, block_size,
                               group) if len(units) else None
    return GroupAttention(window, write_rows, tuple(bucket_to_device(b, device) for b in buckets), in_place)


def _build_decode(batch: ForwardBatch, group: str, window: int | None, page_rows: int) -> GroupAttention:
    """A decode (or verify) step on the CPU: every request in place, no window tiles (fewer queries than a
    tile). What the general path builds, in plain Python over the few requests (a numpy op on arrays this
    small costs ~1 us, a list operation ~0.1; 12 against 43 us a group at batch 1)."""
    block, tables = batch.tokens_per_block, batch.block_tables[group]
    width = max((max(batch.seq_lens) - 1) // block + 1, max(len(t) for t in tables))
    padded = [table + [-1] * (width - len(table)) for table in tables]
    write_rows, first_rows, token = [], [], 0
    for r, (num_queries, seq_len, table) in enumerate(zip(batch.query_lens, batch.seq_lens, padded)):
        first_rows.append(token)
        for position in range(seq_len - num_queries, seq_len):
            page = table[position // block]
            if page < 0:
                raise_unbound(np.array([page]), None, group, f"a KV write (token {token})")
            write_rows.append(page * page_rows * block + position % block)
            token += 1
        first = 0 if window is None else max(0, seq_len - num_queries - window + 1) // block
        read = table[first:(seq_len - 1) // block + 1]
        if min(read) < 0:
            raise_unbound(np.array([read]), None, group, f"attention (request {r}, from block {first})")
    in_place = InPlaceQueries(*as_tensors(*(np.array(v, dtype=np.int64)
                                          for v in (first_rows, batch.query_lens, batch.seq_lens, padded))))
    return GroupAttention(window, torch.from_numpy(np.array(write_rows, dtype=np.int64)), (), in_place)


def _in_place(query_lens: np.ndarray, seq_lens: np.ndarray, window: int | None) -> np.ndarray:
    """Which requests (or tiles) the native kernel attends in place, where it runs: a few queries,
    few queries x keys, or any number in a narrow window."""
    is_narrow = window is not None and window <= _MAX_IN_PLACE_WINDOW
    return (query_lens <= _MAX_IN_PLACE_QUERIES) | (query_lens * seq_lens <= _MAX_IN_PLACE_SCORES) | is_narrow


def _kinds(query_lens, query_starts, seq_lens, window, can_split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Indices of the requests read from pages with a mask, of the fresh ones (causal over their own
    keys), and of the long chunks after a prefix (causal + the prefix): the last two only where
    every query's window, if any, reaches back to position 0."""
    is_unwindowed = seq_lens <= window if window else np.ones_like(seq_lens, dtype=bool)
    fresh = (query_starts == 0) & (query_lens > 1) & is_unwindowed
    split = (query_starts > 0) & (query_lens >= _MIN_SPLIT_QUERIES) & is_unwindowed & can_split
    return np.flatnonzero(~fresh & ~split), np.flatnonzero(fresh), np.flatnonzero(split)


def _window_tiles(query_lens, query_starts, offsets, window):
    """Split every request's new tokens into tiles of ``max(window, _MIN_TILE)`` queries, each then
    attended as a request of its own (a query's keys depend on its position only). A tile of T queries
    reads T + W - 1 keys where the whole chunk read Q + W - 1: prefill of a sliding-window layer costs
    O(Q * (T + W)) instead of O(Q * Q). Returns the tiles' query_lens, query_starts, offsets, and the
    request each belongs to::

        window 32, query_lens [100, 1]  ->  tiles [32, 32, 32, 4, 1], requests [0, 0, 0, 0, 1]
    """
    tile = max(window, _MIN_TILE)
    counts = -(-query_lens // tile)
    units = np.repeat(np.arange(len(query_lens)), counts)
    if len(units) == len(query_lens):
        return query_lens, query_starts, offsets, units
    skip = (np.arange(len(units)) - np.repeat(np.cumsum(counts) - counts, counts)) * tile  # queries before the tile
    return np.minimum(tile, query_lens[units] - skip), query_starts[units] + skip, offsets[units] + skip, units


