"""One request's block tables and the sizes they derive from."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.capacity import get_kv_capacity_tokens, num_blocks


@dataclass
class RequestBlocks:
    """Block tables of one request, one per layer group, indexed by ordinal.

    ``tables[g][i]`` is the page holding positions ``[i*B, (i+1)*B)`` in group
    ``g``, or -1. Ordinals below ``first_bound[g]`` are -1 (out of window and
    released, or never bound); ordinals from there to the table's end are
    bound. The table length is always ``num_ordinals``, derived from the one
    capacity definition.

    ``cached_ordinals[g]``: the ordinals ``allocate`` bound to cached pages
    (their KV existed before the request). ``num_offered_blocks``: blocks below
    it were offered to the prefix cache by ``cache_blocks`` already.
    """

    num_tokens: int
    draft_len: int
    num_extra_kv_tokens: int
    include_drafts: bool
    tokens_per_block: int
    tables: dict[str, list[int]] = field(default_factory=dict)
    first_bound: dict[str, int] = field(default_factory=dict)
    cached_ordinals: dict[str, list[int]] = field(default_factory=dict)
    num_offered_blocks: int = 0

    def capacity_for(self, num_tokens: int) -> int:
        return get_kv_capacity_tokens(
            num_tokens, self.draft_len, self.num_extra_kv_tokens, include_drafts=self.include_drafts
        )

    def ordinals_for(self, num_tokens: int) -> int:
        return num_blocks(self.capacity_for(num_tokens), self.tokens_per_block)

    @property
    def capacity(self) -> int:
        return self.capacity_for(self.num_tokens)

    @property
    def num_ordinals(self) -> int:
        return self.ordinals_for(self.num_tokens)

    def bound_pages(self, group: str) -> list[int]:
        return [page for page in self.tables[group] if page >= 0]
