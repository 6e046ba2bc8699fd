"""The step's new K/V rows into their page slots in Triton: one program per token, K and V each one
contiguous row of ``Hkv * D`` values (the cache's slot layout)::

    slot_mapping[t] = page * B + offset   ->   kv_cache[page, layer, 0 (K) / 1 (V), offset, :, :]
    slot_mapping[t] = -1                  ->   every store masked off: nothing is written
"""

from __future__ import annotations

import triton.language as tl

from engine.gpu.triton_build import jitted, next_power_of_2


def triton_write_kv(kv_cache, layer_index, slot_mapping, key, value) -> None:
    """engine.gpu.paged_attention.write_kv on Triton."""
    if kv_cache.dim() != 6 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [pages, layers, 2, B, Hkv, D] tensor")
    width = kv_cache.shape[4] * kv_cache.shape[5]
    # Cast by torch (round to nearest even), not in the kernel: Triton 3.9's interpreter truncates
    # float32 -> bf16, so a cast inside would differ between CPU tests and GPU. A no-op when equal.
    key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
    for new in (key, value):
        if new.shape != (slot_mapping.shape[0], *kv_cache.shape[4:]) or new.stride(2) != 1 \
                or new.stride(1) != new.shape[2]:
            raise ValueError("key and value must be [N, Hkv, D], each token's Hkv x D contiguous")
    jitted(_write_body)[(slot_mapping.shape[0],)](
        kv_cache, slot_mapping, key, value, key.stride(0), value.stride(0), kv_cache.stride(0),
        layer_index * kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_SIZE=kv_cache.shape[3], WIDTH=width, BLOCK_W=next_power_of_2(width))


def _write_body(cache_ptr, slot_mapping_ptr, key_ptr, value_ptr, key_stride, value_stride, page_stride, layer_offset,
                kv_stride, slot_stride, BLOCK_SIZE: tl.constexpr, WIDTH: tl.constexpr, BLOCK_W: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    mask = cols < tl.where(slot >= 0, WIDTH, 0)  # a -1 slot masks every column
    page, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    target = cache_ptr + page * page_stride + layer_offset + offset * slot_stride + cols
    k = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    v = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    tl.store(target, k, mask=mask)
    tl.store(target + kv_stride, v, mask=mask)
