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
are attended in padded *buckets* (decode steps together, a long
prefill chunk on its own) so no layer loops over requests one by one; in a
sliding-window group a long chunk is first cut into tiles of max(W, 32)
queries, each read as a request of its own (:func:`_window_tiles`).

A *causal* bucket holds fresh prompts (first new token at position 0, no wider
than the window): their keys are this step's own K/V rows, in order, so nothing
is gathered from the pages and the kernel's causal mode skips the blocks above
the diagonal (float32: bit-identical to the explicit mask over the same keys,
1.9x faster at 1,024 queries). On the CPU in float32, a long chunk after a
prefix (``a > 0``, at least ``_MIN_SPLIT_QUERIES`` new tokens, no window in the
way) is a causal bucket of its own with a *prefix*: every query also attends all
of positions ``[0, a)``, read from the pages, in a second kernel call without a
mask; the two are merged by their logsumexps (1.3-1.6x faster than one masked
call over ``[0, S)`` at 1,024 queries)::

    causal bucket    key column c of row i = new token query_rows[i, c]; query j reads c <= j
    with prefix a    + positions 0 .. a-1 from pages block_rows (ordinals 0 .. (a-1)//B), all read
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.forward import ForwardBatch
from engine.native import paged_decode_kernel

# A bucket costs about ``members x max key x (max query + _KEY_COST_ROWS)`` score units: each
# key is gathered (two page copies, zeroed where dead) whatever the queries, and that costs
# about as much as 8 query rows' scores (measured on the CPU, 3 KV heads x 64). Padding may
# reach _BUCKET_WASTE x the real cost plus _BUCKET_SLACK (about one more bucket's dozen op
# calls per layer). Decode steps are all key cost: padding 32 decodes of 50-270 keys to the
# longest read 1.7x their keys, which fell out of cache (8.6 ms per layer in one bucket,
# 4.5 ms in buckets of similar lengths).
_KEY_COST_ROWS = 8
_BUCKET_WASTE = 1.25
_BUCKET_SLACK = 1 << 11
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
class AttentionBucket:
    """Requests attended together, padded to ``R x Q`` queries and ``R x K`` keys (``K = blocks * B``).

    Keys are read a whole page at a time: request r's key ``j`` is position
    ``first_block[r] * B + j``. Rows nobody attends (before the window, past
    ``S - 1``, padding) are zeroed after the gather so leftover NaN/inf in a
    page cannot leak through a zero attention weight.

    A causal bucket (``mask is None``) has the new tokens ``query_rows`` as keys
    (``K = Q``), and query ``j`` attends columns ``0..j``; with ``prefix_len = a > 0``
    (one request) every query also attends positions ``0..a-1``, from pages ``block_rows``.
    """

    query_rows: torch.Tensor  # [R, Q] rows of the N new tokens; padding repeats the last one
    block_rows: torch.Tensor  # [R * blocks] page id * (layers_in_group * 2): row of layer 0's K in the page view
    mask: torch.Tensor | None  # [R, Q, K] bool, True = attend; None: causal over the new tokens
    dead_keys: torch.Tensor  # [M] rows of the flattened R*K keys that no query attends
    out_rows: torch.Tensor  # [M'] rows of the flattened R*Q output that are real queries
    out_tokens: torch.Tensor  # [M'] the rows among the N tokens they belong to
    prefix_len: int = 0  # causal bucket: positions before the chunk that every query reads too


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


def plan_buckets(query_lens: list[int], key_lens: list[int]) -> list[list[int]]:
    """Group request indices, sorted by (query, key) length, so that each group's padded cost
    ``members x max key x (max query + _KEY_COST_ROWS)`` stays within ``_BUCKET_WASTE`` x its
    real cost (``sum key x (query + _KEY_COST_ROWS)``) plus ``_BUCKET_SLACK``."""
    order = sorted(range(len(query_lens)), key=lambda r: (query_lens[r], key_lens[r]))
    buckets: list[list[int]] = []
    current: list[int] = []
    max_q = max_k = work = 0
    for r in order:
        q, k = query_lens[r] + _KEY_COST_ROWS, key_lens[r]
        new_q, new_k, new_work = max(max_q, q), max(max_k, k), work + q * k
        if current and (len(current) + 1) * new_q * new_k > _BUCKET_WASTE * new_work + _BUCKET_SLACK:
            buckets.append(current)
            current, new_q, new_k, new_work = [], q, k, q * k
        current.append(r)
        max_q, max_k, work = new_q, new_k, new_work
    buckets.append(current)
    return buckets


def _padded_table(tables: list[list[int]], min_width: int) -> np.ndarray:
    width = max(min_width, max(len(t) for t in tables))
    table = np.full((len(tables), width), -1, dtype=np.int64)
    for row, ordinals in zip(table, tables):
        row[: len(ordinals)] = ordinals
    return table


def _raise_unbound(pages: np.ndarray, valid: np.ndarray | None, group: str, what: str) -> None:
    """Refuse a read (or write) of an unbound ordinal: ``pages`` where ``valid`` (everywhere: None)."""
    unbound = pages < 0 if valid is None else (pages < 0) & valid
    if unbound.any():
        raise ValueError(f"layer group {group!r}: {what} needs an unbound (-1) block-table ordinal "
                         f"(at {np.argwhere(unbound)[0].tolist()})")


def _build_bucket(members, per_request, table, block_size, window, group, page_rows) -> AttentionBucket:
    """``per_request``: arrays indexed by request
    (query_lens, query_starts, seq_lens, first_blocks, num_blocks, offsets)."""
    rows = np.asarray(members)
    query_lens, query_starts, seq_lens, first_blocks, num_blocks, offsets = (
        values[rows][:, None] for values in per_request
    )
    q_idx = np.arange(query_lens.max())[None]
    q_valid, q_idx = q_idx < query_lens, np.minimum(q_idx, query_lens - 1)
    b_idx = np.arange(num_blocks.max())[None]
    pages = table[rows[:, None], first_blocks + np.minimum(b_idx, num_blocks - 1)]
    _raise_unbound(pages, b_idx < num_blocks, group, "attention")
    k_pos = first_blocks * block_size + np.arange(b_idx.shape[1] * block_size)[None]
    q_pos, query_rows = query_starts + q_idx, offsets + q_idx
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # padding keys lie past S - 1: causality drops them
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    dead_keys = np.flatnonzero(~mask.any(axis=1))
    out_rows = np.flatnonzero(q_valid)
    return AttentionBucket(*_tensors(query_rows, (pages * page_rows).ravel(), mask, dead_keys, out_rows,
                                     query_rows.ravel()[out_rows]))


def _build_causal_bucket(members, query_lens, offsets) -> AttentionBucket:
    """Fresh prompts: queries (and keys) are each request's new tokens, padded with its last one."""
    rows = np.asarray(members)
    query_lens, offsets = query_lens[rows][:, None], offsets[rows][:, None]
    q_idx = np.arange(query_lens.max())[None]
    query_rows = offsets + np.minimum(q_idx, query_lens - 1)
    out_rows = np.flatnonzero(q_idx < query_lens)
    none = np.zeros(0, dtype=np.int64)
    return AttentionBucket(*_tensors(query_rows, none, None, none, out_rows, query_rows.ravel()[out_rows]))


def _build_split_bucket(r, query_lens, query_starts, offsets, table, block_size, group, page_rows):
    """A chunk after ``a`` cached tokens: causal over its own keys, plus every position of ``[0, a)``."""
    a, num_queries, offset = int(query_starts[r]), int(query_lens[r]), int(offsets[r])
    pages = table[r, : (a - 1) // block_size + 1]
    _raise_unbound(pages, None, group, "attention")
    query_rows = np.arange(offset, offset + num_queries)[None]
    none = np.zeros(0, dtype=np.int64)
    return AttentionBucket(*_tensors(query_rows, pages * page_rows, None, none, np.arange(num_queries),
                                     query_rows[0]), prefix_len=a)


def _build_in_place(units, query_lens, seq_lens, first_blocks, offsets, table, block_size, group) -> InPlaceQueries:
    rows = np.asarray(units)
    pages, columns = table[rows], np.arange(table.shape[1])[None]
    read = (columns >= first_blocks[rows, None]) & (columns <= (seq_lens[rows, None] - 1) // block_size)
    _raise_unbound(pages, read, group, "attention")
    return InPlaceQueries(*_tensors(offsets[rows], query_lens[rows], seq_lens[rows], pages))


def _tensors(*arrays: np.ndarray | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)


def _plan(indices: np.ndarray, query_lens: np.ndarray, key_lens: np.ndarray) -> list[list[int]]:
    """:func:`plan_buckets` over the requests ``indices`` only; buckets of their indices."""
    if not len(indices):
        return []
    chosen = plan_buckets(query_lens[indices].tolist(), key_lens[indices].tolist())
    return [indices[bucket].tolist() for bucket in chosen]


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
    _raise_unbound(write_pages, None, group, "a KV write")
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
    buckets = [_build_bucket(members, per_request, table, block_size, window, group, page_rows)
               for members in _plan(paged, query_lens, num_blocks * block_size)]
    buckets += [_build_causal_bucket(members, query_lens, offsets)
                for members in _plan(causal, query_lens, query_lens)]
    buckets += [_build_split_bucket(r, query_lens, query_starts, offsets, table, block_size, group, page_rows)
                for r in split]
    units = np.flatnonzero(is_in_place)
    in_place = _build_in_place(units, query_lens, seq_lens, first_blocks, offsets, table, block_size,
                               group) if len(units) else None
    return GroupAttention(window, write_rows, tuple(_to_device(b, device) for b in buckets), in_place)


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
                _raise_unbound(np.array([page]), None, group, f"a KV write (token {token})")
            write_rows.append(page * page_rows * block + position % block)
            token += 1
        first = 0 if window is None else max(0, seq_len - num_queries - window + 1) // block
        read = table[first:(seq_len - 1) // block + 1]
        if min(read) < 0:
            _raise_unbound(np.array([read]), None, group, f"attention (request {r}, from block {first})")
    in_place = InPlaceQueries(*_tensors(*(np.array(v, dtype=np.int64)
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


def _to_device(bucket: AttentionBucket, device: torch.device | str) -> AttentionBucket:
    return AttentionBucket(*(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                             for t in vars(bucket).values()))
