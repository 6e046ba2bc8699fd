"""Paged KV cache: layer groups, block tables by ordinal, the capacity definition,
the windowed-slice planner, and the prefix cache (block names, reference-counted
pages, the hit rule). Pure Python + torch; imports nothing of the project."""

from kvcache.capacity import get_kv_capacity_tokens, num_blocks
from kvcache.hashing import NO_PARENT, block_hash, block_hashes, extend_block_hashes, kv_fingerprint
from kvcache.manager import KVCacheManager
from kvcache.pool import PagePool
from kvcache.prefix import cached_prefix_length, hit_for_windows, longest_hit
from kvcache.slicing import UNBOUND, KVSliceError, plan_pull, plan_slice, slice_range, stale_end
from kvcache.spec import KVCacheSpec, LayerGroup
from kvcache.storage import PageStorage
from kvcache.summary import BlockSummary

__all__ = [
    "BlockSummary",
    "NO_PARENT",
    "UNBOUND",
    "KVCacheManager",
    "KVCacheSpec",
    "KVSliceError",
    "LayerGroup",
    "PagePool",
    "PageStorage",
    "block_hash",
    "block_hashes",
    "cached_prefix_length",
    "hit_for_windows",
    "extend_block_hashes",
    "get_kv_capacity_tokens",
    "kv_fingerprint",
    "longest_hit",
    "num_blocks",
    "plan_pull",
    "plan_slice",
    "slice_range",
    "stale_end",
]
