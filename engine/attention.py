"""Paged attention over ``kv[group]: [num_pages, num_layers_in_group, 2, B, num_kv_heads, head_dim]``.

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
Requests are attended in padded *buckets* (decode steps together, a long
prefill chunk on its own) so no layer loops over requests one by one; in a
sliding-window group a long chunk is first cut into tiles of max(W, 32)
queries, each read as a request of its own (:func:`_window_tiles`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from engine.forward import ForwardBatch

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
# Key columns of one block of the CPU flash-attention kernel (kvSplitSize in ATen).
_INVARIANT_KEY_BLOCK = 512


@dataclass(frozen=True)
class AttentionBucket:
    """Requests attended together, padded to ``R x Q`` queries and ``R x K`` keys (``K = blocks * B``).

    Keys are read a whole page at a time: request r's key ``j`` is position
    ``first_block[r] * B + j``. Rows nobody attends (before the window, past
    ``S - 1``, padding) are zeroed after the gather so leftover NaN/inf in a
    page cannot leak through a zero attention weight.
    """

    query_rows: torch.Tensor  # [R, Q] rows of the N new tokens; padding repeats the last one
    block_rows: torch.Tensor  # [R * blocks] page id * (layers_in_group * 2): row of layer 0's K in the page view
    mask: torch.Tensor  # [R, Q, K] bool, True = attend
    dead_keys: torch.Tensor  # [M] rows of the flattened R*K keys that no query attends
    out_rows: torch.Tensor  # [M'] rows of the flattened R*Q output that are real queries
    out_tokens: torch.Tensor  # [M'] the rows among the N tokens they belong to


@dataclass(frozen=True)
class GroupAttention:
    """Per forward and layer group: where the new tokens' K/V go, and what each query reads."""

    window: int | None
    write_rows: torch.Tensor  # [N] (page id * layers_in_group * 2) * B + slot: layer 0's K row in the slot view
    buckets: tuple[AttentionBucket, ...]


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


def _raise_unbound(pages: np.ndarray, valid: np.ndarray, group: str, what: str) -> None:
    bad = np.argwhere((pages < 0) & valid)
    if len(bad):
        raise ValueError(
            f"layer group {group!r}: {what} needs an unbound (-1) block-table ordinal (at {bad[0].tolist()})"
        )


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
    arrays = (query_rows, (pages * page_rows).ravel(), mask, dead_keys, out_rows, query_rows.ravel()[out_rows])
    return AttentionBucket(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))


def build_group_attention(
    batch: ForwardBatch, group: str, window: int | None, device: torch.device | str
) -> GroupAttention:
    """Index tensors for one group, built with numpy on the host (a few us per op, where a torch
    op on these small tensors costs 5-10) from the Python lists, then moved: no device sync."""
    block_size = batch.tokens_per_block
    seq_lens, query_lens = np.asarray(batch.seq_lens, dtype=np.int64), np.asarray(batch.query_lens, dtype=np.int64)
    page_rows = 2 * batch.kv_caches[group].shape[1]  # K and V rows of every layer in a page
    query_starts, offsets = seq_lens - query_lens, np.cumsum(query_lens) - query_lens
    table = _padded_table(batch.block_tables[group], int(seq_lens.max() - 1) // block_size + 1)
    # On the CPU ForwardBatch checked that positions equal these; a device tensor would need a sync.
    positions = (batch.positions if batch.positions.device.type == "cpu" else batch.expected_positions()).numpy()
    requests = np.repeat(np.arange(batch.num_requests), query_lens)
    write_pages = table[requests, positions // block_size]
    _raise_unbound(write_pages, np.ones_like(write_pages, dtype=bool), group, "a KV write")
    write_rows = write_pages * page_rows * block_size + positions % block_size
    if window is None:
        first_blocks = np.zeros_like(query_starts)
    else:
        query_lens, query_starts, offsets, units = _window_tiles(query_lens, query_starts, offsets, window)
        seq_lens, table = query_starts + query_lens, table[units]
        first_blocks = np.maximum(0, query_starts - window + 1) // block_size
    num_blocks = (seq_lens - 1) // block_size + 1 - first_blocks
    per_request = (query_lens, query_starts, seq_lens, first_blocks, num_blocks, offsets)
    key_lens = (num_blocks * block_size).tolist()
    buckets = tuple(
        _to_device(_build_bucket(members, per_request, table, block_size, window, group, page_rows), device)
        for members in plan_buckets(query_lens.tolist(), key_lens)
    )
    return GroupAttention(window, torch.from_numpy(write_rows).to(device), buckets)


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
    return AttentionBucket(*(t.to(device, non_blocking=True) for t in vars(bucket).values()))


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_index: int,
    meta: GroupAttention,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write the new tokens' K/V into their pages, then attend. query [N, Hq, D], key/value [N, Hkv, D].

    ``kv_cache`` must be contiguous: it is read through two flat views,
    ``[pages * layers * 2 * B, Hkv * D]`` (one token's K or V per row) for writes
    and ``[pages * layers * 2, B * Hkv * D]`` (one layer's K or V of a page per row) for reads.
    """
    if not kv_cache.is_contiguous():
        raise ValueError("paged_attention needs a contiguous KV page tensor")
    block_size, num_tokens = kv_cache.shape[3], query.shape[0]
    token_rows = kv_cache.view(-1, kv_cache.shape[4] * kv_cache.shape[5])
    k_row = 2 * layer_index
    for row, new in ((k_row, key), (k_row + 1, value)):
        token_rows.index_copy_(0, meta.write_rows + row * block_size, new.reshape(num_tokens, -1).to(kv_cache.dtype))
    page_rows = kv_cache.view(-1, block_size * token_rows.shape[1])
    out = torch.empty_like(query)
    for b in meta.buckets:  # index_select / index_copy_, not [...]: advanced indexing measured ~6x slower on the CPU
        keys = _gather(page_rows, b, k_row, key.shape[1:]).to(query.dtype)
        values = _gather(page_rows, b, k_row + 1, key.shape[1:]).to(query.dtype)
        queries = query.index_select(0, b.query_rows.flatten()).view(*b.query_rows.shape, *query.shape[1:])
        result = attend(queries, keys, values, b.mask, scale, sinks)
        out.index_copy_(0, b.out_tokens, result.flatten(0, 1).index_select(0, b.out_rows))
    return out


def _gather(page_rows: torch.Tensor, bucket: AttentionBucket, row: int, head_shape) -> torch.Tensor:
    """[R, K, Hkv, D] keys (or values) of one layer, dead rows zeroed."""
    gathered = page_rows.index_select(0, bucket.block_rows + row)
    flat = gathered.view(-1, head_shape.numel())
    flat.index_fill_(0, bucket.dead_keys, 0)
    return flat.view(bucket.mask.shape[0], -1, *head_shape)


def key_width(num_columns: int, dtype: torch.dtype, device_type: str = "cpu") -> int:
    """Key columns the kernel gets: as many as there are in float32 (and on GPUs, unmeasured);
    in bf16/fp16 on the CPU a whole number of the flash kernel's 512-key blocks (see :func:`attend`)."""
    if dtype == torch.float32 or device_type != "cpu":
        return num_columns
    return -(-num_columns // _INVARIANT_KEY_BLOCK) * _INVARIANT_KEY_BLOCK


def attend(q, k, v, mask, scale, sinks=None) -> torch.Tensor:
    """q [R, Q, Hq, D], k/v [R, K, Hkv, D], mask [R, Q, K] (True = attend) -> [R, Q, Hq, D], one fused kernel call.

    Sinks (GPT-OSS: one learned logit per head in the softmax denominator) add
    ``exp(sinks[h])`` to each query's denominator. In float32 on the CPU the
    kernel returns each row's logsumexp ``L`` of the real scores, so the output
    is rescaled afterwards, ``out * exp(L) / (exp(L) + exp(s)) = out * sigmoid(L - s)``,
    and the mask stays one [R, 1, Q, width] bias shared by all heads (measured:
    5.66 ms against 7.25 for 8 prompts of 256 tokens, 4 heads of 32). Elsewhere
    the sink is one more key column, first, with a zero key and value and a
    per-head bias ``sinks[h]``, which needs a mask per head:
    ``F.scaled_dot_product_attention`` returns no logsumexp, and in bf16 the
    rescaling rounds the kernel's output twice (logits 5.4-6.0% from float32's
    in the parity test, against 4.1% with the column).

    In bf16/fp16 the key axis is padded with masked columns to whole 512-key
    blocks. The CPU kernel's rounding depends on the number of key columns when
    that is not a whole number of its blocks (measured); with whole blocks, and
    each key at the same column, a request's output is the same bit for bit
    whatever its bucket's padding. bf16 matmuls are row-invariant too, so
    disaggregated == aggregated holds exactly in bf16 (float32 matmuls are not,
    and stay unpadded)::

        key column   [0 (sink column, not float32 CPU)] | keys ...... | padding ... width-1
        bias         [sinks[h]]                   | 0 / -inf    | -inf

    A decode bucket (Q = 1) with grouped KV heads is *folded*: query head
    ``h = kv * G + g`` becomes row ``g`` of KV head ``kv``, so the kernel runs
    ``R x Hkv`` blocks of G rows instead of ``R x Hq`` single rows, each KV head's keys
    read once (measured 15% less time for 32 decodes, G = 3)::

        q [R, 1, Hq, D] --view--> [R, Hkv, G, D]     mask [R, 1, 1, K] broadcast over G
    """
    num_req, num_q, num_heads, head_size = q.shape
    rescale = sinks is not None and q.device.type == "cpu" and q.dtype == torch.float32
    lead, num_k, num_kv = int(sinks is not None and not rescale), k.shape[1], k.shape[2]
    width = key_width(lead + num_k, q.dtype, q.device.type)
    if width != num_k:
        k, v = (_place_keys(t, lead, width) for t in (k, v))
        padded = mask.new_zeros(num_req, num_q, width)
        padded[..., lead : lead + num_k] = mask
        mask = padded
    is_folded = num_q == 1 and num_heads > num_kv
    heads, rows = (num_kv, num_heads // num_kv) if is_folded else (num_heads, num_q)
    if is_folded:
        q, k, v = q.reshape(num_req, heads, rows, head_size), k.transpose(1, 2), v.transpose(1, 2)
    else:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    attn_mask = mask[:, None]  # [R, 1, Q, width]: folded, Q = 1 broadcasts over the group's rows
    if rescale:
        out = _attend_rescaled(q, k, v, attn_mask.expand(num_req, 1, rows, width), scale,
                               sinks.to(torch.float32).view(heads, rows if is_folded else 1))
    else:
        if sinks is not None:
            attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
            attn_mask = attn_mask.expand(num_req, heads, rows, width).contiguous()
            attn_mask[..., 0] = sinks.to(q.dtype).view(heads, rows) if is_folded else sinks.to(q.dtype)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, enable_gqa=not is_folded)
    if is_folded:
        return out.reshape(num_req, 1, num_heads, head_size)
    return out.transpose(1, 2)


def _attend_rescaled(q, k, v, mask, scale, sinks) -> torch.Tensor:
    """The CPU flash kernel without sinks, then each row scaled by ``sigmoid(logsumexp - sink)``.

    q [R, H, Q, D], k/v [R, Hkv, K, D], mask [R, 1, Q, K] bool, sinks [H, Q or 1] float32.
    """
    if k.shape[1] != q.shape[1]:  # grouped KV heads: the kernel takes as many as the queries have
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    bias = torch.zeros((), dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias, scale=scale)
    return out * torch.sigmoid(logsumexp - sinks).unsqueeze(-1)


def _place_keys(keys: torch.Tensor, lead: int, width: int) -> torch.Tensor:
    placed = keys.new_zeros(keys.shape[0], width, *keys.shape[2:])
    placed[:, lead : lead + keys.shape[1]] = keys
    return placed
