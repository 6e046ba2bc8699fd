"""Buckets: requests attended together in one padded kernel call, and the cost model that groups them.

``engine.attention_plan`` sorts a step's requests by how they are read (in place, from the pages
with a mask, fresh prompts, long chunks after a prefix); this module groups the masked and the
fresh ones into buckets of similar lengths and builds each bucket's index tensors, with numpy on
the host, so no layer loops over requests one by one.

A *masked* bucket reads its keys from the pages, a whole page at a time, and zeroes
the key rows no query attends. A *causal* bucket holds fresh prompts (first new
token at position 0, no wider than the window): their keys are this step's own K/V
rows, in order, so nothing is gathered from the pages and the kernel's causal mode
skips the blocks above the diagonal (float32: bit-identical to the explicit mask
over the same keys, 1.9x faster at 1,024 queries). On the CPU in float32, a long
chunk after a prefix (``a > 0``, at least ``_MIN_SPLIT_QUERIES`` new tokens, no window
in the way: ``engine.attention_plan`` picks them) is a causal bucket of its own with
a *prefix*: every query also attends all of positions ``[0, a)``, read from the
pages, in a second kernel call without a mask; the two are merged by their
logsumexps (1.3-1.6x faster than one masked call over ``[0, S)`` at 1,024 queries)::

    causal bucket    key column c of row i = new token query_rows[i, c]; query j reads c <= j
    with prefix a    + positions 0 .. a-1 from pages block_rows (ordinals 0 .. (a-1)//B), all read
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

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


def plan_buckets_of(indices: np.ndarray, query_lens: np.ndarray, key_lens: np.ndarray) -> list[list[int]]:
    """:func:`plan_buckets` over the requests ``indices`` only; buckets of their indices."""
    if not len(indices):
        return []
    chosen = plan_buckets(query_lens[indices].tolist(), key_lens[indices].tolist())
    return [indices[bucket].tolist() for bucket in chosen]


def build_masked_bucket(members, per_request, table, block_size, window, group, page_rows) -> AttentionBucket:
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
    raise_unbound(pages, b_idx < num_blocks, group, "attention")
    k_pos = first_blocks * block_size + np.arange(b_idx.shape[1] * block_size)[None]
    q_pos, query_rows = query_starts + q_idx, offsets + q_idx
    mask = k_pos[:, None, :] <= q_pos[:, :, None]  # padding keys lie past S - 1: causality drops them
    if window is not None:
        mask &= k_pos[:, None, :] > q_pos[:, :, None] - window
    dead_keys = np.flatnonzero(~mask.any(axis=1))
    out_rows = np.flatnonzero(q_valid)
    return AttentionBucket(*as_tensors(query_rows, (pages * page_rows).ravel(), mask, dead_keys, out_rows,
                                       query_rows.ravel()[out_rows]))


def build_causal_bucket(members, query_lens, offsets) -> AttentionBucket:
    """Fresh prompts: queries (and keys) are each request's new tokens, padded with its last one."""
    rows = np.asarray(members)
    query_lens, offsets = query_lens[rows][:, None], offsets[rows][:, None]
    q_idx = np.arange(query_lens.max())[None]
    query_rows = offsets + np.minimum(q_idx, query_lens - 1)
    out_rows = np.flatnonzero(q_idx < query_lens)
    none = np.zeros(0, dtype=np.int64)
    return AttentionBucket(*as_tensors(query_rows, none, None, none, out_rows, query_rows.ravel()[out_rows]))


def build_split_bucket(r, query_lens, query_starts, offsets, table, block_size, group, page_rows):
    """A chunk after ``a`` cached tokens: causal over its own keys, plus every position of ``[0, a)``."""
    a, num_queries, offset = int(query_starts[r]), int(query_lens[r]), int(offsets[r])
    pages = table[r, : (a - 1) // block_size + 1]
    raise_unbound(pages, None, group, "attention")
    query_rows = np.arange(offset, offset + num_queries)[None]
    none = np.zeros(0, dtype=np.int64)
    return AttentionBucket(*as_tensors(query_rows, pages * page_rows, None, none, np.arange(num_queries),
                                       query_rows[0]), prefix_len=a)


def bucket_to_device(bucket: AttentionBucket, device: torch.device | str) -> AttentionBucket:
    return AttentionBucket(*(t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
                             for t in vars(bucket).values()))


def raise_unbound(pages: np.ndarray, valid: np.ndarray | None, group: str, what: str) -> None:
    """Refuse a read (or write) of an unbound ordinal: ``pages`` where ``valid`` (everywhere: None)."""
    unbound = pages < 0 if valid is None else (pages < 0) & valid
    if unbound.any():
        raise ValueError(f"layer group {group!r}: {what} needs an unbound (-1) block-table ordinal "
                         f"(at {np.argwhere(unbound)[0].tolist()})")


def as_tensors(*arrays: np.ndarray | None) -> tuple[torch.Tensor | None, ...]:
    return tuple(None if a is None else torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
