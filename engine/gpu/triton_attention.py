"""Paged decode attention in Triton: each key read in place through the block table, nothing gathered.

One program per (token, KV head, split) attends all ``G = Hq / Hkv`` query heads of its KV head, so
each key is loaded once for the group. It walks its keys ``BLOCK_K`` positions at a time; position
k's page comes from the token's table row, so a tile may straddle pages and B need not be a power
of two::

    keys of token t      lo = max(0, p - W + 1) ........................ p
    split s of S         [lo + s*c, lo + (s+1)*c)        c = ceil((p + 1 - lo) / S)
    tile                 k0 .. k0 + BLOCK_K - 1   ->  page table[row, k // B], slot k % B
    read only where      k < end and table[row, k // B] >= 0    (masked loads: nothing else is touched)

Online softmax (running max m, denominator l, weighted values acc) in float32. With one split the
sink starts the running sums (m = sink, l = 1: a key of logit ``sinks[h]`` and value 0). With S
splits each writes acc / l and its logsumexp ``m + log l``; :func:`_combine_body` merges them, the
sink once, in a second kernel::

    out = sum_s exp(lse_s - top) * part_s / (sum_s exp(lse_s - top) + exp(sink - top))

The two dots per tile run in float32 (``input_precision="ieee"``: no TF32) when the query or the
pages are float32; bf16/fp16 pages and queries dot in their own type with float32 accumulation.
Under the interpreter they always dot in float32: Triton 3.9's interpreter multiplies bf16 operands
as their raw uint16 bits (its ``create_dot`` converts only 8-bit floats). So the bf16 dot is the
one piece CI compiles (tests/engine/gpu/test_triton_compile.py) but cannot run; bench/gpu_check.sh's
``triton`` step runs the same tests on a GPU.
"""

from __future__ import annotations

import torch
import triton.language as tl

from engine.gpu.triton_build import is_interpreted, jitted, next_power_of_2

_NO_SCORE = tl.constexpr(-1.0e30)  # the running max before any key: finite, so an empty tile gives exp(0), never NaN


def triton_decode_attention(query, kv_cache, layer_index, block_tables, table_rows, positions, *,
                            window, scale, sinks=None, out=None, num_splits=1) -> torch.Tensor:
    """engine.gpu.paged_attention.paged_decode_attention on Triton (see there for the contract)."""
    _check(query, kv_cache, block_tables, out)
    num_tokens, num_heads, head_dim = query.shape
    num_kv = kv_cache.shape[4]
    out = torch.empty_like(query) if out is None else out
    is_split = num_splits > 1
    parts = query.new_empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32) if is_split else out
    lse = query.new_empty((num_tokens, num_heads, num_splits), dtype=torch.float32) if is_split else out
    sinks_arg = sinks.float().contiguous() if sinks is not None else query
    constants, num_warps = decode_constants(num_heads // num_kv, head_dim, kv_cache.shape[3], has_window=window
                                            is not None, has_sinks=sinks is not None, is_split=is_split,
                                            dot_fp32=is_interpreted() or torch.float32 in (query.dtype, kv_cache.dtype))
    jitted(_decode_body)[(num_tokens, num_kv, num_splits)](
        query, kv_cache, block_tables, table_rows, positions, sinks_arg, parts, lse,
        query.stride(0), query.stride(1), parts.stride(0), parts.stride(1), block_tables.stride(0),
        kv_cache.stride(0), layer_index * kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        window or 0, scale, num_splits, **constants, num_warps=num_warps)
    if is_split:
        jitted(_combine_body)[(num_tokens, num_heads)](
            parts, lse, sinks_arg, out, parts.stride(0), parts.stride(1), out.stride(0), out.stride(1),
            num_splits, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim), BLOCK_S=next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None)
    return out


def decode_constants(group: int, head_dim: int, block_size: int, *, has_window: bool, has_sinks: bool,
                     is_split: bool, dot_fp32: bool) -> tuple[dict, int]:
    """The decode kernel's compile-time constants and its warps per program.

    ``tl.dot`` needs every side at least 16: the G query heads are padded to 16 rows. A key tile of
    ``BLOCK_K x BLOCK_D = 2048`` values with 8 warps compiles for sm_90 without register spills in
    float32 and bf16 at D = 64 and 128 (4 warps, or 4096-value tiles, spilled: 255 registers and
    48-6744 bytes of stack, cuobjdump on the sm_90 cubin; tests/engine/gpu/test_triton_compile.py
    keeps it so). Whether wider tiles at lower occupancy run faster is unmeasured (no GPU at hand).
    """
    block_d = next_power_of_2(head_dim, 16)
    constants = dict(BLOCK_SIZE=block_size, GROUP=group, BLOCK_G=next_power_of_2(group, 16), HEAD_DIM=head_dim,
                     BLOCK_D=block_d, BLOCK_K=max(16, 2048 // block_d), HAS_WINDOW=has_window, HAS_SINKS=has_sinks,
                     IS_SPLIT=is_split, DOT_FP32=dot_fp32)
    return constants, 8


def _check(query, kv_cache, block_tables, out) -> None:
    """Shapes and layouts only: nothing here reads a tensor's values (no host sync)."""
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [pages, layers, 2, B, Hkv, D] tensor")
    if query.dim() != 3 or query.shape[2] != kv_cache.shape[5] or query.shape[1] % kv_cache.shape[4]:
        raise ValueError(f"query {tuple(query.shape)} does not fit kv_cache {tuple(kv_cache.shape)}")
    if query.stride(2) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query's head dimension and block_tables' rows must be contiguous")
    if out is not None and (out.shape != query.shape or out.stride(2) != 1):
        raise ValueError("out must be [N, Hq, D] with a contiguous head dimension")


def _decode_body(query_ptr, cache_ptr, tables_ptr, table_rows_ptr, positions_ptr, sinks_ptr, out_ptr, lse_ptr,
                 query_token_stride, query_head_stride, out_token_stride, out_head_stride, table_stride,
                 page_stride, layer_offset, kv_stride, slot_stride, window, scale, num_splits,
                 BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
                 IS_SPLIT: tl.constexpr, DOT_FP32: tl.constexpr):
    token, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    row = tl.load(table_rows_ptr + token).to(tl.int64)
    lo = tl.maximum(pos - window + 1, 0) if HAS_WINDOW else pos * 0
    per_split = tl.cdiv(tl.maximum(pos + 1 - lo, 0), num_splits)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, pos + 1)
    g, d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads, head_mask, dim_mask = kv_head * GROUP + g, g < GROUP, d < HEAD_DIM
    q = tl.load(query_ptr + token * query_token_stride + heads[:, None] * query_head_stride + d[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    m = tl.full([BLOCK_G], _NO_SCORE, tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    if HAS_SINKS and not IS_SPLIT:
        m = tl.load(sinks_ptr + heads, mask=head_mask, other=_NO_SCORE).to(tl.float32)
        total += 1.0
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    head_offset = kv_head * HEAD_DIM
    for k0 in range(start, end, BLOCK_K):
        keys = k0 + tl.arange(0, BLOCK_K)
        page = tl.load(tables_ptr + row * table_stride + keys // BLOCK_SIZE, mask=keys < end, other=-1).to(tl.int64)
        live = (keys < end) & (page >= 0)
        slot = cache_ptr + page * page_stride + layer_offset + (keys % BLOCK_SIZE) * slot_stride + head_offset
        k = tl.load(slot[None, :] + d[:, None], mask=live[None, :] & dim_mask[:, None], other=0.0)  # [D, K]
        v = tl.load(slot[:, None] + kv_stride + d[None, :], mask=live[:, None] & dim_mask[None, :], other=0.0)
        if DOT_FP32:
            scores = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            scores = tl.dot(q.to(k.dtype), k)
        scores = tl.where(live[None, :], scores * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    result = acc / tl.where(total > 0, total, 1.0)[:, None]
    out_rows = out_ptr + token * out_token_stride + heads[:, None] * out_head_stride
    if IS_SPLIT:
        tl.store(out_rows + split * HEAD_DIM + d[None, :], result, mask=head_mask[:, None] & dim_mask[None, :])
        lse = tl.where(total > 0, m + tl.log(tl.maximum(total, 1e-30)), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP  # lse: [N, Hq, S] contiguous
        tl.store(lse_ptr + (token * num_heads + heads) * num_splits + split, lse, mask=head_mask)
    else:
        tl.store(out_rows + d[None, :], result.to(out_ptr.dtype.element_ty),
                 mask=head_mask[:, None] & dim_mask[None, :])


def _combine_body(parts_ptr, lse_ptr, sinks_ptr, out_ptr, parts_token_stride, parts_head_stride, out_token_stride,
                  out_head_stride, num_splits, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    s, d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    split_mask = s < num_splits
    lse = tl.load(lse_ptr + (token * tl.num_programs(1) + head) * num_splits + s, mask=split_mask,
                  other=float("-inf"))
    top = tl.max(lse, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - top)
    rows = parts_ptr + token * parts_token_stride + head * parts_head_stride
    parts = tl.load(rows + s[:, None] * HEAD_DIM + d[None, :], mask=split_mask[:, None] & (d[None, :] < HEAD_DIM),
                    other=0.0)
    result = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * out_token_stride + head * out_head_stride + d, result.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)
