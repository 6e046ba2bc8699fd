"""The prefix-cache hit rule: which cached blocks a prompt may reuse, decided by positions.

A hit of ``h`` tokens means the KV of positions ``[0, h)`` is taken from the
cache and the first computed query sits at position ``h``. ``h`` is a
multiple of ``B`` (only full blocks have names) and at most ``P - 1``: one
prompt token is always computed, for the first token's logits.

Queries at ``h`` and later read, per group, keys from ``stale_end(h)`` on, so
a hit of ``h`` needs, in each group::

    needed(h) = ordinals [stale_end(h, W, B), h / B)       stale_end = 0 for a full group

    ordinal:  0  ...  stale_end(h)-1 | stale_end(h) ... h/B - 1 | h/B ...
              never read again: -1   | must be cached           | computed (fresh pages)

The hit is the largest ``h`` that every group allows. For a window group the
rule is not monotone, so the search runs from the largest candidate down.
Worked example: ``B=8, W=16, P=40``; the full group holds blocks 0..3, the
window group held 0..3 too but blocks 0 and 1 were evicted::

    h    full needs   window needs   stale_end(h) = max(0, (h + 1 - 16) // 8)    window holds {2, 3}
    32   0 1 2 3      2 3            (33 - 16) // 8 = 2                           hit
    24   0 1 2        1 2            (25 - 16) // 8 = 1                           miss (1)
    16   0 1          0 1            0                                            miss (0, 1)
     8   0            0              0                                            miss (0)

With blocks 0..3 cached in both groups, ``h = 32`` needs full blocks 0..3 and
window blocks 2 and 3 only; the window ordinals 0 and 1 stay -1, as vLLM's
sliding-window manager leaves them null. Counting matching blocks instead
("the window spans 2 blocks and 2 are cached") would also accept ``h = 32``
when the window group holds only 0 and 1, the prefix's stale head: the
queries would then read pages that hold nothing.
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence

from kvcache.pool import PagePool
from kvcache.request_blocks import RequestBlocks
from kvcache.slicing import stale_end
from kvcache.spec import KVCacheSpec


def longest_hit(cached: Sequence[tuple[int | None, Sequence[bool]]], tokens_per_block: int) -> int:
    """The largest hit ``h`` (tokens) every group allows; 0 when none.

    ``cached`` has one ``(window, is_cached)`` pair per group, where
    ``is_cached[i]`` says whether block ``i`` of the prompt is cached in that
    group; the candidates are ``h = k*B`` for ``k <= len(is_cached)``, so the
    caller bounds the lists by ``(P - 1) // B``.
    """
    lengths = {len(flags) for _, flags in cached}
    if len(lengths) > 1:
        raise ValueError(f"groups disagree on the number of candidate blocks: {sorted(lengths)}")
    num_candidates = lengths.pop() if lengths else 0
    last_miss = [(window, _last_miss_below(flags)) for window, flags in cached]
    for k in range(num_candidates, 0, -1):
        h = k * tokens_per_block
        if all(misses[k] < stale_end(h, window, tokens_per_block) for window, misses in last_miss):
            return h
    return 0


def _last_miss_below(is_cached: Sequence[bool]) -> list[int]:
    """``out[k]`` = the largest ``j < k`` with block ``j`` not cached, or -1.

    ``[s, k)`` is all cached exactly when ``out[k] < s``.
    """
    out, last = [-1], -1
    for j, hit in enumerate(is_cached):
        if not hit:
            last = j
        out.append(last)
    return out


def cached_prefix_length(
    spec: KVCacheSpec,
    cached_hashes: Mapping[str, Container[bytes]],
    block_hashes: Sequence[bytes],
    num_prompt_tokens: int,
) -> int:
    """The hit for a prompt of ``num_prompt_tokens`` named by ``block_hashes``, given the
    names each group holds (a manager's pools, or what a router knows of a replica)."""
    windows = {g.name: g.window for g in spec.groups}
    return hit_for_windows(windows, spec.tokens_per_block, cached_hashes, block_hashes, num_prompt_tokens)


def hit_for_windows(
    windows: Mapping[str, int | None],
    tokens_per_block: int,
    cached_hashes: Mapping[str, Container[bytes]],
    block_hashes: Sequence[bytes],
    num_prompt_tokens: int,
) -> int:
    """``cached_prefix_length`` from each group's window alone (what a router knows of a replica)."""
    num_candidates = min(len(block_hashes), max(0, num_prompt_tokens - 1) // tokens_per_block)
    candidates = block_hashes[:num_candidates]
    cached = [(window, [h in cached_hashes[name] for h in candidates]) for name, window in windows.items()]
    return longest_hit(cached, tokens_per_block)


def find_hit_pages(
    pools: Mapping[str, PagePool], first_bound: Mapping[str, int], end: int, block_hashes: Sequence[bytes]
) -> dict[str, dict[int, int]]:
    """Per group, ``{ordinal: cached page}`` for each cached block in ``[first_bound, end)``.

    Per ordinal, with no prefix requirement: a chain hash names the whole
    prefix, so a cached block ``i`` is right for this request wherever its
    neighbours are.
    """
    end = min(end, len(block_hashes))
    hits = {}
    for name, pool in pools.items():
        found = ((i, pool.cached_page(block_hashes[i])) for i in range(first_bound[name], end))
        hits[name] = {i: page for i, page in found if page is not None}
    return hits


def cached_ordinals(pool: PagePool, table: Sequence[int], ordinals: range) -> list[int]:
    """The ordinals of ``table`` in ``ordinals`` bound to a page that holds a cached block."""
    return [i for i in ordinals if table[i] >= 0 and pool.hash_of(table[i]) is not None]


def offer_blocks(
    pools: Mapping[str, PagePool], blocks: RequestBlocks, block_hashes: Sequence[bytes], end: int
) -> int:
    """Name each bound block of ``blocks`` below ordinal ``end`` not offered before; returns how many got one."""
    end = min(end, len(block_hashes))
    num_named = 0
    for name, pool in pools.items():
        table = blocks.tables[name]
        for ordinal in range(max(blocks.first_bound[name], blocks.num_offered_blocks), end):
            num_named += pool.cache(table[ordinal], block_hashes[ordinal])
    blocks.num_offered_blocks = max(blocks.num_offered_blocks, end)
    return num_named
