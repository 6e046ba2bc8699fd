"""The attention kernels over the buckets ``engine.attention_plan`` plans (``engine.attention_buckets``): write the new
tokens' K/V into their pages, gather each bucket's keys, one fused kernel call per bucket."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention_buckets import AttentionBucket
from engine.attention_plan import GroupAttention
from engine.native import paged_decode_kernel, write_kv_kernel

# Key columns of one block of the CPU flash-attention kernel (kvSplitSize in ATen).
_INVARIANT_KEY_BLOCK = 512
# On CUDA, every SDPA backend but cuDNN's: cuDNN builds an execution plan per new shape, and a
# bucket's key width changes nearly every step: 7.4 ms of host time per call in bf16 on an H200,
# 84% of a decode step (docs/gpu.md). Float32 never took the cuDNN backend.
_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


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
    if _writes_natively(kv_cache, key, value):
        write_kv_kernel()(kv_cache, layer_index, meta.write_rows, key, value)
    else:
        for row, new in ((k_row, key), (k_row + 1, value)):
            token_rows.index_copy_(0, meta.write_rows + row * block_size,
                                   new.reshape(num_tokens, -1).to(kv_cache.dtype))
    page_rows = kv_cache.view(-1, block_size * token_rows.shape[1])
    out = query.new_empty(query.shape)
    if meta.in_place is not None:
        _attend_in_place(query, kv_cache, layer_index, meta, scale, sinks, out)
    for b in meta.buckets:  # index_select / index_copy_, not [...]: advanced indexing measured ~6x slower on the CPU
        queries = _new_rows(query, b)
        if b.mask is None and b.prefix_len:  # a long chunk: causal over its own keys, plus the prefix
            prefix = [_prefix(page_rows, b, row, key.shape[1:]).to(query.dtype) for row in (k_row, k_row + 1)]
            result = attend_with_prefix(queries, _new_rows(key, b), _new_rows(value, b), prefix, scale, sinks)
        elif b.mask is None:  # fresh prompts: the keys are the new tokens themselves
            result = attend(queries, _new_rows(key, b), _new_rows(value, b), None, scale, sinks)
        else:
            keys = _gather(page_rows, b, k_row, key.shape[1:]).to(query.dtype)
            values = _gather(page_rows, b, k_row + 1, key.shape[1:]).to(query.dtype)
            result = attend(queries, keys, values, b.mask, scale, sinks)
        out.index_copy_(0, b.out_tokens, result.flatten(0, 1).index_select(0, b.out_rows))
    return out


def _writes_natively(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """float32 pages and rows on the CPU, each token's K (and V) rows contiguous: engine.native's write_kv."""
    return (kv_cache.dtype == key.dtype == value.dtype == torch.float32 and kv_cache.device.type == "cpu"
            and all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
            and write_kv_kernel() is not None)


def _attend_in_place(query, kv_cache, layer_index, meta: GroupAttention, scale, sinks, out) -> None:
    """The native kernel's rows of ``out``: each request's few queries against its keys, read in the pages."""
    p = meta.in_place
    paged_decode_kernel()(query, kv_cache, layer_index, p.first_rows, p.query_lens, p.seq_lens, p.tables,
                          meta.window or 0, scale, None if sinks is None else sinks.float(), out)


def _new_rows(rows: torch.Tensor, bucket: AttentionBucket) -> torch.Tensor:
    """[R, Q, H, D] of this step's ``rows`` [N, H, D], as the bucket lays its queries out."""
    return rows.index_select(0, bucket.query_rows.flatten()).view(*bucket.query_rows.shape, *rows.shape[1:])


def _prefix(page_rows: torch.Tensor, bucket: AttentionBucket, row: int, head_shape) -> torch.Tensor:
    """[1, a, Hkv, D]: keys (or values) of positions 0..a-1 of the bucket's one request."""
    return page_rows.index_select(0, bucket.block_rows + row).view(1, -1, *head_shape)[:, : bucket.prefix_len]


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

    ``mask=None``: causal, ``K = Q`` (query ``j`` attends keys ``0..j``). In float32 the kernel's
    causal mode (no mask tensor, blocks above the diagonal skipped) where it has one (no sinks, or
    sinks through the logsumexp); otherwise the lower-triangular mask is built here.

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
    is_causal = mask is None and num_q > 1 and q.dtype == torch.float32 and (rescale or sinks is None)
    if mask is None and not is_causal:
        mask = torch.ones(num_q, k.shape[1], dtype=torch.bool, device=q.device).tril().expand(num_req, -1, -1)
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
    attn_mask = None if is_causal else mask[:, None]  # [R, 1, Q, width]: folded, Q = 1 broadcasts over G rows
    if rescale:
        out = _attend_rescaled(q, k, v, None if is_causal else attn_mask.expand(num_req, 1, rows, width), scale,
                               sinks.to(torch.float32).view(heads, rows if is_folded else 1))
    else:
        if sinks is not None:
            attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
            attn_mask = attn_mask.expand(num_req, heads, rows, width).contiguous()
            attn_mask[..., 0] = sinks.to(q.dtype).view(heads, rows) if is_folded else sinks.to(q.dtype)[:, None]
        with sdpa_kernel(_CUDA_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale, is_causal=is_causal,
                                                 enable_gqa=not is_folded)
    if is_folded:
        return out.reshape(num_req, 1, num_heads, head_size)
    return out.transpose(1, 2)


def _attend_rescaled(q, k, v, mask, scale, sinks) -> torch.Tensor:
    """The CPU flash kernel without sinks, then each row scaled by ``sigmoid(logsumexp - sink)``.

    q [R, H, Q, D], k/v [R, Hkv, K, D], mask [R, 1, Q, K] bool (None: causal), sinks [H, Q or 1] float32.
    """
    k, v = _per_query_head(k, q.shape[1]), _per_query_head(v, q.shape[1])
    bias = None if mask is None else torch.zeros((), dtype=q.dtype).masked_fill(~mask, float("-inf"))
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, is_causal=mask is None, attn_mask=bias, scale=scale)
    return out * torch.sigmoid(logsumexp - sinks).unsqueeze(-1)


def attend_with_prefix(q, k, v, prefix, scale, sinks=None) -> torch.Tensor:
    """Float32 on the CPU. q/k/v [R, Q, H(kv), D] as :func:`attend` with ``mask=None`` (causal over the
    chunk's own keys), and every query also attends all of ``prefix = (keys, values)`` [R, a, Hkv, D]:
    two kernel calls, merged by their logsumexps ``L_c`` (causal) and ``L_p`` (prefix)::

        out = out_c + (out_p - out_c) * sigmoid(L_p - L_c)        L = logaddexp(L_c, L_p)

    and with sinks, ``out * sigmoid(L - sinks[h])`` as in :func:`_attend_rescaled`.
    """
    heads = q.shape[2]
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    q, k, v, prefix_k, prefix_v = (t.transpose(1, 2) for t in (q, k, v, *prefix))  # [R, H(kv), len, D]
    out, lse = kernel(q, _per_query_head(k, heads), _per_query_head(v, heads), is_causal=True, scale=scale)
    out_p, lse_p = kernel(q, _per_query_head(prefix_k, heads), _per_query_head(prefix_v, heads), scale=scale)
    out = out.add_((out_p - out).mul_(torch.sigmoid(lse_p - lse).unsqueeze(-1)))
    if sinks is not None:
        lse = torch.logaddexp(lse, lse_p)
        out = out.mul_(torch.sigmoid(lse - sinks.to(torch.float32).view(heads, 1)).unsqueeze(-1))
    return out.transpose(1, 2)


def _per_query_head(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[R, Hkv, K, D] as the CPU kernel takes it: as it is where the kernel maps query head ``h`` to KV
    head ``h // G`` itself (torch 2.13: bit-identical, no copy; 4-11% less time per causal prefill
    call, docs/benchmarks.md), else repeated to [R, num_heads, K, D]."""
    if t.shape[1] == num_heads or _kernel_takes_grouped_heads():
        return t
    return t.repeat_interleave(num_heads // t.shape[1], dim=1)


@functools.cache
def _kernel_takes_grouped_heads() -> bool:
    """Whether this torch's CPU flash kernel accepts fewer KV heads than query heads, with the same
    result as the repeated heads (probed once on a tiny input)."""
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, 3, 8, generator=generator) for heads in (4, 2, 2))
    try:
        grouped = kernel(q, k, v, is_causal=True, scale=0.5)
    except RuntimeError:
        return False
    repeated = kernel(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True, scale=0.5)
    return all(torch.equal(a, b) for a, b in zip(grouped, repeated))


def _place_keys(keys: torch.Tensor, lead: int, width: int) -> torch.Tensor:
    placed = keys.new_zeros(keys.shape[0], width, *keys.shape[2:])
    placed[:, lead : lead + keys.shape[1]] = keys
    return placed
