"""The invariants every page and every block table keeps, checked in one place,
and the one operation (rewind) that could break them unless refused.

    page:   free | evictable-cached | owned, ref_count == number of (request, ordinal) bindings
    table:  [-1] * first_bound + [bound page] * (num_ordinals - first_bound)
    cached: a request binds a cached block only below num_tokens // B, so no
            later write of the request can change a block another may read
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from kvcache.pool import PagePool
from kvcache.prefix import cached_ordinals
from kvcache.request_blocks import RequestBlocks
from kvcache.slicing import UNBOUND, stale_end
from kvcache.spec import KVCacheSpec


def check_pools(pools: Mapping[str, PagePool], requests: Mapping[str, RequestBlocks]) -> None:
    """Raise AssertionError on the first broken invariant."""
    for name, pool in pools.items():
        owners: Counter[int] = Counter()
        for request_id, blocks in requests.items():
            check_table(request_id, name, blocks, pool)
            owners.update(blocks.bound_pages(name))
        pool.check(owners)


def check_table(request_id: str, group: str, blocks: RequestBlocks, pool: PagePool) -> None:
    table, first = blocks.tables[group], blocks.first_bound[group]
    where = f"{request_id}/{group}"
    if len(table) != blocks.num_ordinals:
        raise AssertionError(f"{where}: table has {len(table)} entries, capacity needs {blocks.num_ordinals}")
    if any(page != UNBOUND for page in table[:first]) or any(page < 0 for page in table[first:]):
        raise AssertionError(f"{where}: table {table} not -1 below {first} and bound above")
    past = cached_ordinals(pool, table, range(blocks.num_tokens // blocks.tokens_per_block, len(table)))
    if past:
        raise AssertionError(f"{where}: ordinals {past} hold cached blocks past its {blocks.num_tokens} tokens")


def rewind_refusal(
    spec: KVCacheSpec, pools: Mapping[str, PagePool], request_id: str, blocks: RequestBlocks, num_tokens: int
) -> str | None:
    """Why rewinding the request to ``n' = num_tokens`` would break an invariant, or None.

    The next query at ``n'`` reads window keys from ``stale_end(n')``: none of
    them may be released already. Kept ordinals ``[n' // B, ordinals_for(n'))``
    hold positions ``>= n'`` that the next tokens overwrite, so none may hold a
    cached block: another request could be reading it. Ordinals beyond are
    unbound (a cached one stays evictable, its content still matching its name).
    """
    prefix = f"cannot rewind request {request_id!r} to {num_tokens} tokens"
    if not 0 <= num_tokens <= blocks.num_tokens:
        return f"{prefix} (has {blocks.num_tokens})"
    B = spec.tokens_per_block
    for group in spec.groups:
        needed, first = stale_end(num_tokens, group.window, B), blocks.first_bound[group.name]
        if first > needed:
            return f"{prefix}: group {group.name!r} released ordinals below {first}, the next query needs {needed}"
    kept = range(num_tokens // B, blocks.ordinals_for(num_tokens))
    for name, pool in pools.items():
        cached = cached_ordinals(pool, blocks.tables[name], kept)
        if cached:
            return f"{prefix}: group {name!r} ordinals {cached} hold cached blocks the next tokens would overwrite"
    return None
