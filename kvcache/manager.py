"""KVCacheManager: pages, layer groups and per-request block tables.

Each layer group has its own page pool and page tensor. Pools are separate
(vLLM's hybrid allocator shares one) because the groups need very different
numbers of pages: a sliding-window group binds at most
``ceil((W + D + E) / B) + 1`` pages per request whatever the prompt, while a
full group binds ``ceil(capacity / B)``. Separate pools let each be sized to
its own need, keep one page size per pool, and make each group one
registered memory region for a transport.

Life of a request (``n`` = tokens whose KV is held, ``D`` drafts, ``E`` extra)::

    allocate(n, num_computed_tokens=c)   binds ordinals [stale_end(c), ceil(cap(n)/B))
    append(k)                            n += k, binds the new tail ordinals
    release_stale(c)                     unbinds window ordinals below stale_end(c)
    rewind(n')                           n = n' < n, unbinds ordinals past ceil(cap(n')/B)
    free()                               every page back to its pool

``cap(n) = get_kv_capacity_tokens(n, D, E, include_drafts=...)``. Drafts live
in the reserved scratch ``[n, n + D)`` and never enter ``n`` until accepted.
"""

from __future__ import annotations

from typing import Mapping

import torch

from kvcache.pool import PagePool
from kvcache.request_blocks import RequestBlocks
from kvcache.slicing import UNBOUND, stale_end
from kvcache.spec import KVCacheSpec
from kvcache.storage import PageStorage


class KVCacheManager:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_pages: int | Mapping[str, int],
        *,
        device: str | torch.device = "cpu",
        allocate_storage: bool = True,
    ) -> None:
        sizes = {g.name: num_pages for g in spec.groups} if isinstance(num_pages, int) else dict(num_pages)
        missing = [g.name for g in spec.groups if g.name not in sizes]
        if missing:
            raise ValueError(f"num_pages has no entry for groups {missing}")
        self.spec = spec
        self.pools = {g.name: PagePool(sizes[g.name]) for g in spec.groups}
        self.storage = PageStorage(spec, sizes, device) if allocate_storage else None
        self._requests: dict[str, RequestBlocks] = {}

    # -- queries ---------------------------------------------------------
    def num_free_pages(self, group: str | None = None) -> int:
        if group is not None:
            return self.pools[group].num_free
        return sum(pool.num_free for pool in self.pools.values())

    def num_total_pages(self, group: str | None = None) -> int:
        if group is not None:
            return self.pools[group].num_pages
        return sum(pool.num_pages for pool in self.pools.values())

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def num_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_tokens

    def get_block_ordinals(self, request_id: str, group: str) -> list[int]:
        """One entry per block of capacity: page id, or -1 where none is bound."""
        return list(self._get(request_id).tables[group])

    # -- allocate --------------------------------------------------------
    def can_allocate(
        self,
        num_tokens: int,
        *,
        num_computed_tokens: int = 0,
        draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        include_drafts: bool = True,
    ) -> bool:
        blocks = self._new_blocks(num_tokens, draft_len, num_extra_kv_tokens, include_drafts)
        first = self._first_bound(num_computed_tokens, blocks.num_ordinals)
        return all(blocks.num_ordinals - first[name] <= pool.num_free for name, pool in self.pools.items())

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        num_computed_tokens: int = 0,
        draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        include_drafts: bool = True,
    ) -> None:
        """Bind pages for ``num_tokens`` (+ scratch); window ordinals stale at ``num_computed_tokens`` stay -1."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has KV blocks")
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside [0, {num_tokens}]")
        kwargs = dict(num_computed_tokens=num_computed_tokens, draft_len=draft_len,
                      num_extra_kv_tokens=num_extra_kv_tokens, include_drafts=include_drafts)
        if not self.can_allocate(num_tokens, **kwargs):
            raise MemoryError(f"not enough free pages for request {request_id!r}")
        blocks = self._new_blocks(num_tokens, draft_len, num_extra_kv_tokens, include_drafts)
        blocks.first_bound = self._first_bound(num_computed_tokens, blocks.num_ordinals)
        for name, pool in self.pools.items():
            first = blocks.first_bound[name]
            blocks.tables[name] = [UNBOUND] * first + pool.take(blocks.num_ordinals - first)
        self._requests[request_id] = blocks

    # -- grow, shrink, release -------------------------------------------
    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        blocks = self._get(request_id)
        grow = blocks.ordinals_for(blocks.num_tokens + num_new_tokens) - blocks.num_ordinals
        return all(grow <= pool.num_free for pool in self.pools.values())

    def append(self, request_id: str, num_new_tokens: int) -> None:
        """Hold ``num_new_tokens`` more tokens, binding pages for the new tail ordinals."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if not self.can_append(request_id, num_new_tokens):
            raise MemoryError(f"not enough free pages to grow request {request_id!r}")
        blocks = self._get(request_id)
        new_len = blocks.ordinals_for(blocks.num_tokens + num_new_tokens)
        for name, pool in self.pools.items():
            table = blocks.tables[name]
            table.extend(pool.take(new_len - len(table)))
        blocks.num_tokens += num_new_tokens

    def release_stale(self, request_id: str, num_computed_tokens: int) -> int:
        """Unbind window pages that no query at or after ``num_computed_tokens`` reads.

        Returns the number of pages given back. Full groups are untouched.
        """
        blocks = self._get(request_id)
        # Accepted drafts are computed before append() commits them: up to capacity is valid.
        if not 0 <= num_computed_tokens <= blocks.capacity:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside [0, {blocks.capacity}]")
        released = 0
        for group in self.spec.groups:
            end = min(stale_end(num_computed_tokens, group.window, self.spec.tokens_per_block), blocks.num_ordinals)
            table, start = blocks.tables[group.name], blocks.first_bound[group.name]
            if end <= start:
                continue
            self.pools[group.name].give_back(table[start:end])
            table[start:end] = [UNBOUND] * (end - start)
            blocks.first_bound[group.name] = end
            released += end - start
        return released

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request to ``num_tokens`` tokens, unbinding ordinals past the new capacity.

        Refuses (ValueError) to rewind to a point whose next query would read a
        window page that was already released.
        """
        blocks = self._get(request_id)
        if not 0 <= num_tokens <= blocks.num_tokens:
            raise ValueError(f"cannot rewind request {request_id!r} to {num_tokens} tokens (has {blocks.num_tokens})")
        for group in self.spec.groups:
            needed = stale_end(num_tokens, group.window, self.spec.tokens_per_block)
            if blocks.first_bound[group.name] > needed:
                raise ValueError(
                    f"cannot rewind request {request_id!r} to {num_tokens} tokens: group {group.name!r} "
                    f"released ordinals below {blocks.first_bound[group.name]}, the next query needs {needed}"
                )
        new_len = blocks.ordinals_for(num_tokens)
        for name, pool in self.pools.items():
            table = blocks.tables[name]
            pool.give_back([page for page in table[new_len:] if page >= 0])
            del table[new_len:]
            blocks.first_bound[name] = min(blocks.first_bound[name], new_len)
        blocks.num_tokens = num_tokens

    def free(self, request_id: str) -> None:
        """Give every page of the request back. Freeing an unknown request is a no-op."""
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return
        for name, pool in self.pools.items():
            pool.give_back(blocks.bound_pages(name))

    # -- checks ----------------------------------------------------------
    def check_integrity(self) -> None:
        """Every page is free or owned by exactly one (request, group, ordinal); raises AssertionError."""
        for name, pool in self.pools.items():
            owners: dict[int, tuple[str, int]] = {}
            for request_id, blocks in self._requests.items():
                self._check_table(request_id, name, blocks)
                for ordinal, page in enumerate(blocks.tables[name]):
                    if page < 0:
                        continue
                    if page in owners:
                        raise AssertionError(f"group {name}: page {page} owned by {owners[page]} and {(request_id, ordinal)}")
                    if pool.is_free(page):
                        raise AssertionError(f"group {name}: page {page} is free but bound to {(request_id, ordinal)}")
                    owners[page] = (request_id, ordinal)
            if len(owners) + pool.num_free != pool.num_pages:
                raise AssertionError(f"group {name}: {len(owners)} owned + {pool.num_free} free != {pool.num_pages}")

    # -- helpers ---------------------------------------------------------
    def _get(self, request_id: str) -> RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} has no KV blocks") from None

    def _new_blocks(self, num_tokens: int, draft_len: int, num_extra: int, include_drafts: bool) -> RequestBlocks:
        return RequestBlocks(num_tokens, draft_len, num_extra, include_drafts, self.spec.tokens_per_block)

    def _first_bound(self, num_computed_tokens: int, num_ordinals: int) -> dict[str, int]:
        B = self.spec.tokens_per_block
        return {g.name: min(stale_end(num_computed_tokens, g.window, B), num_ordinals) for g in self.spec.groups}

    def _check_table(self, request_id: str, group: str, blocks: RequestBlocks) -> None:
        table, first = blocks.tables[group], blocks.first_bound[group]
        if len(table) != blocks.num_ordinals:
            raise AssertionError(f"{request_id}/{group}: table has {len(table)} entries, capacity needs {blocks.num_ordinals}")
        if any(page != UNBOUND for page in table[:first]) or any(page < 0 for page in table[first:]):
            raise AssertionError(f"{request_id}/{group}: table {table} not -1 below {first} and bound above")
