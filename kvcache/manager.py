"""KVCacheManager: pages, layer groups, per-request block tables, and the prefix cache.

Each layer group has its own page pool and page tensor. Pools are separate
(vLLM's hybrid allocator shares one) because the groups need very different
numbers of pages: a sliding-window group binds at most
``ceil((W + D + E) / B) + 1`` pages per request whatever the prompt, while a
full group binds ``ceil(capacity / B)``. Separate pools let each be sized to
its own need, keep one page size per pool, and make each group one
registered memory region for a transport.

Life of a request (``n`` = tokens whose KV is held, ``D`` drafts, ``E`` extra,
``hashes = block_hashes(token_ids, B, extra)``)::

    h = find_cached_prefix(hashes, P)      hit: KV of [0, h) is cached (rule in prefix.py)
    allocate(n, num_computed_tokens=c,     binds ordinals [stale_end(c), ceil(cap(n)/B)):
             block_hashes=hashes)            cached pages where block i < c/B is cached, fresh elsewhere
    cache_blocks(hashes, c)                names the full blocks below c once their KV is written
    append(k)                              n += k, binds the new tail ordinals
    release_stale(c)                       unbinds window ordinals below stale_end(c)
    rewind(n')                             n = n' < n, unbinds ordinals past ceil(cap(n')/B)
    free()                                 drops every binding

``cap(n) = get_kv_capacity_tokens(n, D, E, include_drafts=...)``. Drafts live
in the reserved scratch ``[n, n + D)`` and never enter ``n`` until accepted.

Roles: a context side computing a prompt passes ``c = h``; a generation side
receiving a prompt by transfer passes ``c = P`` (all of its KV will exist)
and drops ``get_cached_ordinals`` from the transfer. Pages are
reference-counted: a page bound by several requests is released once per
binding, and a cached page nobody binds is evictable, not lost (pool.py).
With ``enable_prefix_caching=False`` nothing is ever cached, and every call
behaves as it did before the cache existed.

This class keeps the requests and checks its callers' arguments; what each
call does to one request's tables (which ordinals gain or lose pages) is in
binding.py.
"""

from __future__ import annotations

from collections.abc import KeysView, Mapping, Sequence

import torch

from kvcache import binding
from kvcache.integrity import check_pools, rewind_refusal
from kvcache.pool import PagePool
from kvcache.prefix import cached_prefix_length, offer_blocks
from kvcache.request_blocks import RequestBlocks
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
        enable_prefix_caching: bool = False,
        eviction: str = "lru",
    ) -> None:
        sizes = {g.name: num_pages for g in spec.groups} if isinstance(num_pages, int) else dict(num_pages)
        missing = [g.name for g in spec.groups if g.name not in sizes]
        if missing:
            raise ValueError(f"num_pages has no entry for groups {missing}")
        self.spec = spec
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = {g.name: PagePool(sizes[g.name], eviction) for g in spec.groups}
        self.storage = PageStorage(spec, sizes, device) if allocate_storage else None
        self._requests: dict[str, RequestBlocks] = {}

    # -- queries ---------------------------------------------------------
    def _count(self, attribute: str, group: str | None) -> int:
        """A pool count of ``group``, or summed over every group when ``group`` is None."""
        pools = self.pools.values() if group is None else (self.pools[group],)
        return sum(getattr(pool, attribute) for pool in pools)

    def num_free_pages(self, group: str | None = None) -> int:
        """Pages an allocation can take: free ones and evictable cached ones."""
        return self._count("num_free", group)

    def num_empty_pages(self, group: str | None = None) -> int:
        """Free pages that hold no cached block: an allocation this size evicts nothing."""
        return self._count("num_empty", group)

    def num_total_pages(self, group: str | None = None) -> int:
        return self._count("num_pages", group)

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

    def get_cached_ordinals(self, request_id: str, group: str) -> list[int]:
        """Ordinals ``allocate`` bound to cached pages: their KV exists, a transfer skips them."""
        return list(self._get(request_id).cached_ordinals[group])

    def num_cached_blocks(self, group: str | None = None) -> int:
        """Blocks the prefix cache can name, owned or evictable."""
        return self._count("num_cached", group)

    def cached_block_hashes(self, group: str) -> KeysView[bytes]:
        """Names of the blocks cached in ``group`` (a live view: copy it to keep it)."""
        return self.pools[group].cached_hashes()

    # -- prefix cache ----------------------------------------------------
    def find_cached_prefix(self, block_hashes: Sequence[bytes], num_prompt_tokens: int) -> int:
        """The hit ``h``: the largest multiple of B, at most ``P - 1``, every group holds (prefix.py)."""
        if not self.enable_prefix_caching:
            return 0
        cached = {name: pool.cached_hashes() for name, pool in self.pools.items()}
        return cached_prefix_length(self.spec, cached, block_hashes, num_prompt_tokens)

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes], num_computed_tokens: int) -> int:
        """Name the request's bound full blocks below ``num_computed_tokens``; returns how many became cached.

        Call once their KV is written (the engine after a step, before
        ``release_stale``; a generation side after a pull). Only blocks inside
        the held tokens are named: accepted drafts not yet appended wait for
        the next call. A block another page already holds keeps that page;
        this request's copy stays unnamed.
        """
        if not self.enable_prefix_caching:
            return 0
        blocks = self._get(request_id)
        if not 0 <= num_computed_tokens <= blocks.capacity:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside [0, {blocks.capacity}]")
        end = min(num_computed_tokens, blocks.num_tokens) // self.spec.tokens_per_block
        return offer_blocks(self.pools, blocks, block_hashes, end)

    # -- allocate --------------------------------------------------------
    def can_allocate(
        self,
        num_tokens: int,
        *,
        num_computed_tokens: int = 0,
        draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        include_drafts: bool = True,
        block_hashes: Sequence[bytes] = (),
    ) -> bool:
        """Whether ``allocate`` with the same arguments finds the pages: fresh ones plus evictable hits it pins."""
        return binding.has_room(self.pools, *self._plan(num_tokens, num_computed_tokens, draft_len,
                                                        num_extra_kv_tokens, include_drafts, block_hashes))

    def allocate(
        self,
        request_id: str,
        num_tokens: int,
        *,
        num_computed_tokens: int = 0,
        draft_len: int = 0,
        num_extra_kv_tokens: int = 0,
        include_drafts: bool = True,
        block_hashes: Sequence[bytes] = (),
    ) -> None:
        """Bind pages for ``num_tokens`` (+ scratch); window ordinals stale at ``num_computed_tokens`` stay -1.

        Each ordinal ``i`` in ``[first_bound, num_computed_tokens // B)`` whose
        block ``block_hashes[i]`` is cached in a group binds that cached page
        (``get_cached_ordinals``); every other ordinal gets a fresh page. Fresh
        pages below ``num_computed_tokens`` hold nothing yet: the caller fills
        them (a transfer), or passes the hit of ``find_cached_prefix``, whose
        blocks are all cached.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already has KV blocks")
        if not 0 <= num_computed_tokens <= num_tokens:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside [0, {num_tokens}]")
        kwargs = {"num_computed_tokens": num_computed_tokens, "draft_len": draft_len, "block_hashes": block_hashes,
                  "num_extra_kv_tokens": num_extra_kv_tokens, "include_drafts": include_drafts}
        if not self.can_allocate(num_tokens, **kwargs):
            raise MemoryError(f"not enough free pages for request {request_id!r}")
        blocks, hits = self._plan(num_tokens, num_computed_tokens, draft_len, num_extra_kv_tokens,
                                  include_drafts, block_hashes)
        binding.bind_allocation(self.pools, blocks, hits)
        self._requests[request_id] = blocks

    # -- grow, shrink, release -------------------------------------------
    def can_append(self, request_id: str, num_new_tokens: int) -> bool:
        return binding.can_grow(self.pools, self._get(request_id), num_new_tokens)

    def append(self, request_id: str, num_new_tokens: int) -> None:
        """Hold ``num_new_tokens`` more tokens, binding pages for the new tail ordinals."""
        if not self.try_append(request_id, num_new_tokens):
            raise MemoryError(f"not enough free pages to grow request {request_id!r}")

    def try_append(self, request_id: str, num_new_tokens: int) -> bool:
        """:meth:`append` where the pages are free (True); otherwise nothing changes (False)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks = self._get(request_id)
        if not binding.can_grow(self.pools, blocks, num_new_tokens):
            return False
        binding.grow(self.pools, blocks, num_new_tokens)
        return True

    def release_stale(self, request_id: str, num_computed_tokens: int) -> int:
        """Unbind window pages that no query at or after ``num_computed_tokens`` reads.

        Returns the number of pages unbound; a cached one stays evictable.
        Full groups are untouched.
        """
        blocks = self._get(request_id)
        # Accepted drafts are computed before append() commits them: up to capacity is valid.
        if not 0 <= num_computed_tokens <= blocks.capacity:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} outside [0, {blocks.capacity}]")
        return binding.release_stale(self.spec, self.pools, blocks, num_computed_tokens)

    def can_rewind(self, request_id: str, num_tokens: int) -> bool:
        return rewind_refusal(self.spec, self.pools, request_id, self._get(request_id), num_tokens) is None

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Shrink the request to ``num_tokens`` tokens, unbinding ordinals past the new capacity.

        Refuses (ValueError) to rewind to a point whose next query would read a
        window page that was already released, or whose next tokens would
        overwrite a cached block (integrity.rewind_refusal).
        """
        refusal = rewind_refusal(self.spec, self.pools, request_id, self._get(request_id), num_tokens)
        if refusal is not None:
            raise ValueError(refusal)
        binding.shrink(self.pools, self._get(request_id), num_tokens)

    def free(self, request_id: str) -> None:
        """Drop every binding of the request. Freeing an unknown request is a no-op.

        Pages go back last ordinal first, so among a request's cached blocks
        the tail is evicted before the head that every longer hit needs.
        """
        blocks = self._requests.pop(request_id, None)
        if blocks is None:
            return
        for name, pool in self.pools.items():
            pool.release(reversed(blocks.bound_pages(name)))

    # -- checks ----------------------------------------------------------
    def check_integrity(self) -> None:
        """Every page is free, evictable-cached, or owned by exactly ``ref_count`` bindings;
        tables keep their shape; no request binds a cached block past its tokens. Raises AssertionError."""
        check_pools(self.pools, self._requests)

    # -- helpers ---------------------------------------------------------
    def _get(self, request_id: str) -> RequestBlocks:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} has no KV blocks") from None

    def _plan(
        self, num_tokens: int, num_computed_tokens: int, draft_len: int, num_extra: int,
        include_drafts: bool, block_hashes: Sequence[bytes],
    ) -> tuple[RequestBlocks, binding.Hits]:
        """:func:`binding.plan_allocation` over this manager's pools."""
        return binding.plan_allocation(self.spec, self.pools, num_tokens, num_computed_tokens, draft_len, num_extra,
                                       include_drafts, block_hashes)
