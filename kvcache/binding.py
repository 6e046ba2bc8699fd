"""Which ordinals of one request's block tables hold a page, and how they gain and lose them.

``KVCacheManager`` keeps the requests and checks its callers' arguments; these
functions change one request's tables (``RequestBlocks``) and the pools' pages
together. ``c`` = num_computed_tokens, ``n`` = tokens held,
``cap(n) = get_kv_capacity_tokens(n, D, E, include_drafts=...)``. Per group::

    ordinal:  0 .. first_bound - 1 | first_bound .. c/B - 1   | c/B .. ceil(cap(n)/B) - 1
    table:    -1 (stale at c)      | cached page where hit,   | fresh page (computed later,
                                   | fresh page elsewhere     | drafts' scratch, extra slots)

    first_bound = min(stale_end(c, W, B), ceil(cap(n)/B))      0 for a full group

``grow`` binds fresh pages past the old end, ``release_stale`` moves
``first_bound`` up (unbinding what lies below it), and ``shrink`` cuts the tail
back to ``ceil(cap(n')/B)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvcache.pool import PagePool
from kvcache.prefix import find_hit_pages
from kvcache.request_blocks import RequestBlocks
from kvcache.slicing import UNBOUND, stale_end
from kvcache.spec import KVCacheSpec

Hits = dict[str, dict[int, int]]  # per group: ordinal -> the cached page it binds


def plan_allocation(
    spec: KVCacheSpec, pools: Mapping[str, PagePool], num_tokens: int, num_computed_tokens: int, draft_len: int,
    num_extra: int, include_drafts: bool, block_hashes: Sequence[bytes],
) -> tuple[RequestBlocks, Hits]:
    """A new request's sizes and first bound ordinals (tables still empty), and its cache hits."""
    B = spec.tokens_per_block
    blocks = RequestBlocks(num_tokens, draft_len, num_extra, include_drafts, B)
    blocks.first_bound = {g.name: min(stale_end(num_computed_tokens, g.window, B), blocks.num_ordinals)
                          for g in spec.groups}
    return blocks, find_hit_pages(pools, blocks.first_bound, num_computed_tokens // B, block_hashes)


def has_room(pools: Mapping[str, PagePool], blocks: RequestBlocks, hits: Hits) -> bool:
    """Whether every pool has the planned request's fresh pages plus the evictable hits it pins."""
    for name, pool in pools.items():
        num_fresh = blocks.num_ordinals - blocks.first_bound[name] - len(hits[name])
        num_pinned_evictable = sum(pool.is_evictable(page) for page in hits[name].values())
        if num_fresh + num_pinned_evictable > pool.num_free:
            return False
    return True


def bind_allocation(pools: Mapping[str, PagePool], blocks: RequestBlocks, hits: Hits) -> None:
    """Fill the planned request's tables: its hits, and fresh pages at every other bound ordinal."""
    for name, pool in pools.items():
        blocks.tables[name] = _bind(pool, blocks.first_bound[name], blocks.num_ordinals, hits[name])
        blocks.cached_ordinals[name] = sorted(hits[name])


def _bind(pool: PagePool, first: int, num_ordinals: int, hits: Mapping[int, int]) -> list[int]:
    """``[-1] * first``, then per ordinal its cached page or a fresh one.

    Hits are pinned before fresh pages are taken, so taking cannot evict them.
    """
    for page in hits.values():
        pool.pin(page)
    fresh = iter(pool.take(num_ordinals - first - len(hits)))
    return [UNBOUND] * first + [hits[i] if i in hits else next(fresh) for i in range(first, num_ordinals)]


def can_grow(pools: Mapping[str, PagePool], blocks: RequestBlocks, num_new_tokens: int) -> bool:
    grow_by = blocks.ordinals_for(blocks.num_tokens + num_new_tokens) - blocks.num_ordinals
    return grow_by <= 0 or all(grow_by <= pool.num_free for pool in pools.values())


def grow(pools: Mapping[str, PagePool], blocks: RequestBlocks, num_new_tokens: int) -> None:
    """Hold ``num_new_tokens`` more tokens: fresh pages for the new tail ordinals (``can_grow`` first).
    Most decode steps stay inside the last page: no pool is asked then."""
    new_len = blocks.ordinals_for(blocks.num_tokens + num_new_tokens)
    for name, pool in pools.items():
        table = blocks.tables[name]
        if new_len > len(table):
            table.extend(pool.take(new_len - len(table)))
    blocks.num_tokens += num_new_tokens


def release_stale(spec: KVCacheSpec, pools: Mapping[str, PagePool], blocks: RequestBlocks,
                  num_computed_tokens: int) -> int:
    """Unbind window ordinals ``[first_bound, stale_end(c))``; returns how many. Full groups keep theirs."""
    released = 0
    for group in spec.groups:
        end = min(stale_end(num_computed_tokens, group.window, spec.tokens_per_block), blocks.num_ordinals)
        table, start = blocks.tables[group.name], blocks.first_bound[group.name]
        if end <= start:
            continue
        pools[group.name].release(table[start:end])
        table[start:end] = [UNBOUND] * (end - start)
        blocks.first_bound[group.name] = end
        released += end - start
    return released


def shrink(pools: Mapping[str, PagePool], blocks: RequestBlocks, num_tokens: int) -> None:
    """Hold ``num_tokens`` tokens only: unbind ordinals from ``ordinals_for(num_tokens)`` on, last first
    (``integrity.rewind_refusal`` first)."""
    new_len = blocks.ordinals_for(num_tokens)
    for name, pool in pools.items():
        table = blocks.tables[name]
        pool.release([page for page in reversed(table[new_len:]) if page >= 0])
        del table[new_len:]
        blocks.first_bound[name] = min(blocks.first_bound[name], new_len)
    blocks.num_tokens = num_tokens
    blocks.num_offered_blocks = min(blocks.num_offered_blocks, num_tokens // blocks.tokens_per_block)
