"""Paged KV cache: layer groups, block tables by ordinal, the capacity definition,
and the windowed-slice planner. Pure Python + torch; imports nothing of the project."""

from kvcache.capacity import get_kv_capacity_tokens, num_blocks
from kvcache.manager import KVCacheManager
from kvcache.pool import PagePool
from kvcache.slicing import UNBOUND, KVSliceError, plan_slice, slice_range, stale_end
from kvcache.spec import KVCacheSpec, LayerGroup
from kvcache.storage import PageStorage

__all__ = [
    "UNBOUND",
    "KVCacheManager",
    "KVCacheSpec",
    "KVSliceError",
    "LayerGroup",
    "PagePool",
    "PageStorage",
    "get_kv_capacity_tokens",
    "num_blocks",
    "plan_slice",
    "slice_range",
    "stale_end",
]
