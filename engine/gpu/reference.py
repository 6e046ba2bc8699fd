"""Torch references of the GPU decode kernels: the same semantics as engine.gpu's Triton kernels, in
fixed-shape torch ops (no host sync, no data-dependent shape), so a CUDA graph can capture them where
Triton is missing. They gather every row's whole block table, which is what the kernels avoid.

Cache layout (engine.kvcache's pages): ``kv_cache [pages, L, 2, B, Hkv, D]`` contiguous; one token's
K (or V) of one layer is a row of the flat view ``[pages * L * 2 * B, Hkv * D]``::

    row(page, layer, kv, offset) = ((page * L + layer) * 2 + kv) * B + offset      kv: 0 = K, 1 = V
"""

from __future__ import annotations

import torch


def reference_decode_attention(query, kv_cache, layer_index, block_tables, table_rows, positions, *,
                               window: int | None, scale: float, sinks=None, out=None) -> torch.Tensor:
    """See engine.gpu.paged_attention.paged_decode_attention. Float32 arithmetic, output in query's dtype.

    Token t reads key columns ``k = 0 .. M*B-1`` of its table row (column k: page ``table[k // B]``,
    slot ``k % B``), gathered whole; a column counts only if ``lo <= k <= pos`` and its page is bound::

        k      0 ......... lo ......... pos ........ M*B-1
        reads  [ dropped ][---- live ----][ dropped ]         lo = max(0, pos - W + 1) (0 without W)

    Dropped columns are zeroed before any arithmetic (an unbound ordinal gathers page 0, whatever it
    holds; a NaN times a zero weight would still be NaN). A padded row (pos = -1) has no live column:
    its output is 0.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv = kv_cache.shape[3], kv_cache.shape[4]
    tables = block_tables.index_select(0, table_rows.long()).long()  # [N, M]
    columns = torch.arange(tables.shape[1] * block_size, device=query.device)
    live = _live_columns(tables, columns, positions.long(), block_size, window)  # [N, K]
    pages = kv_cache.select(1, layer_index).index_select(0, tables.clamp(min=0).flatten())  # [N*M, 2, B, Hkv, D]
    pages = pages.view(num_tokens, -1, 2, block_size, num_kv, head_dim).float()
    pages = pages.where(live.view(num_tokens, -1, 1, block_size, 1, 1), 0.0)
    keys = pages[:, :, 0].reshape(num_tokens, -1, num_kv, head_dim)  # [N, K, Hkv, D]
    values = pages[:, :, 1].reshape(num_tokens, -1, num_kv, head_dim)
    grouped = query.float().view(num_tokens, num_kv, num_heads // num_kv, head_dim)  # head h = kv * G + g
    scores = torch.einsum("nhgd,nkhd->nhgk", grouped, keys) * scale
    scores = scores.masked_fill(~live[:, None, None, :], float("-inf"))
    top = scores.amax(dim=-1)  # [N, Hkv, G]
    sink_logits = None if sinks is None else sinks.float().view(1, num_kv, -1)
    if sink_logits is not None:
        top = torch.maximum(top, sink_logits)
    top = top.masked_fill(top == float("-inf"), 0.0)  # no live column, no sink: every weight is 0
    weights = torch.exp(scores - top[..., None])
    total = weights.sum(dim=-1)
    if sink_logits is not None:
        total = total + torch.exp(sink_logits - top)
    result = torch.einsum("nhgk,nkhd->nhgd", weights, values) / total.clamp(min=1e-30)[..., None]
    result = result.reshape(num_tokens, num_heads, head_dim)
    if out is None:
        return result.to(query.dtype)
    out.copy_(result)
    return out


def _live_columns(tables, columns, positions, block_size: int, window: int | None) -> torch.Tensor:
    """[N, K] bool: column k is a key token t reads (in its window, at most its position, page bound)."""
    pos = positions[:, None]
    live = (columns[None, :] <= pos) & (tables.repeat_interleave(block_size, dim=1) >= 0)
    if window is not None:
        live &= columns[None, :] > pos - window
    return live


def reference_write_kv(kv_cache, layer_index, slot_mapping, key, value) -> None:
    """K/V of token t into slot ``slot_mapping[t] = page * B + offset``; -1 writes nothing.

    One ``index_copy_`` per K and V with fixed shapes: a -1 row is redirected to the first live
    row's target with that row's own data (the same bytes written twice, so the order of duplicate
    writes cannot matter), or, in a step without any live row, to flat row 0 with what it holds.
    Two live rows with one slot are the caller's error (which one lands is undefined).
    """
    num_layers, block_size = kv_cache.shape[1], kv_cache.shape[3]
    token_rows = kv_cache.view(-1, kv_cache.shape[4] * kv_cache.shape[5])
    slots = slot_mapping.long()
    is_live = slots >= 0
    first_live = is_live.int().argmax()  # 0 when none is live
    any_live = is_live.any()
    page, offset = slots.clamp(min=0) // block_size, slots.clamp(min=0) % block_size
    k_rows = (page * num_layers + layer_index) * 2 * block_size + offset
    for rows, new in ((k_rows, key), (k_rows + block_size, value)):
        new = new.reshape(new.shape[0], -1).to(kv_cache.dtype)
        # index_select, not rows[first_live]: indexing by a 0-dim tensor reads it on the host (.item(),
        # a sync that a CUDA graph's capture refuses)
        stand_in_row = torch.where(any_live, rows.index_select(0, first_live.view(1))[0], 0)
        stand_in = torch.where(any_live, new.index_select(0, first_live.view(1))[0], token_rows[0])
        target = torch.where(is_live, rows, stand_in_row)
        data = torch.where(is_live[:, None], new, stand_in[None, :])
        token_rows.index_copy_(0, target, data)
