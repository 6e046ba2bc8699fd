"""The invariants every page and every block table keeps, checked in one place.

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
from kvcache.slicing import UNBOUND


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
