"""Which blocks of a handed-over request a generation side will ever read, paired by ordinal.

``N`` = ``num_kv_tokens``: the positions whose KV travels, the prompt and all
handed-over outputs but the last (``engine.handoff``: ``N = P + k - 1``, the
prompt alone when k = 1). For a group with window ``W``, in blocks of ``B``::

    ordinal:   0      1      ...  stale_end-1 | stale_end ...  T-1 | T ...
    tokens:  [0,B) [B,2B)  ...               | prompt, t0..t(k-2) | drafts, extra slots
             <--- no future query reads ---> | <--- the slice ---> | <- never travels ->

    stale_end = max(0, (N + 1 - W) // B)   (0 for a full-attention group)
    T         = ceil(N / B)

The generation side's first query (token t(k-1)) sits at position ``N`` and
reads keys ``[N - W + 1, N]``; block ``i`` is stale when its last token
``(i+1)B - 1`` is below ``N - W + 1``, i.e. ``i < (N + 1 - W) / B``.

Pairs are made by ordinal: entry ``i`` of the source table goes to entry
``i`` of the destination table. Nothing here trims a table by count.

A receiver with a prefix cache already holds some slice ordinals (the pages
``allocate`` bound from its cache); ``plan_pull`` drops exactly those, by
ordinal, and the rest of the slice keeps its pairs::

    ordinal:    0    1    2    3    4        B=8, W=16, N=36: slice [2, 5)
    src:       c0   c1   c2   c3   c4
    dst:       -1   -1   g2   g3   g4        cached ordinals {3}
    pulled:              c2->g2     c4->g4   (3 is read from g3 where it lies)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvcache.capacity import num_blocks

UNBOUND = -1


class KVSliceError(ValueError):
    """The sender lacks a block the receiver needs, or a table is too short."""


def stale_end(num_tokens: int, window: int | None, tokens_per_block: int) -> int:
    """Number of leading blocks that no query at or after position ``num_tokens`` reads."""
    if num_tokens < 0 or tokens_per_block < 1:
        raise ValueError(f"bad num_tokens={num_tokens} or tokens_per_block={tokens_per_block}")
    if window is None:
        return 0
    return max(0, (num_tokens + 1 - window) // tokens_per_block)


def slice_range(num_kv_tokens: int, window: int | None, tokens_per_block: int) -> range:
    """Ordinals ``[stale_end, T)`` that hold KV a query at or after ``num_kv_tokens`` reads."""
    return range(
        stale_end(num_kv_tokens, window, tokens_per_block),
        num_blocks(num_kv_tokens, tokens_per_block),
    )


def plan_slice(
    src_ordinals: Sequence[int],
    dst_ordinals: Sequence[int],
    num_kv_tokens: int,
    window: int | None,
    tokens_per_block: int,
) -> list[tuple[int, int, int]]:
    """``(ordinal, src_page, dst_page)`` for each ordinal of the slice whose dst is bound.

    A ``-1`` in ``dst`` means the receiver has or does not want that block:
    it is skipped and its neighbours keep their ordinals. A ``-1`` in ``src``
    inside the slice, or a table shorter than the slice, raises KVSliceError
    before anything is planned, so nothing moves.
    """
    ordinals = slice_range(num_kv_tokens, window, tokens_per_block)
    for name, table in (("source", src_ordinals), ("destination", dst_ordinals)):
        if len(table) < ordinals.stop:
            raise KVSliceError(
                f"{name} table has {len(table)} entries but the slice needs ordinals "
                f"{ordinals.start}..{ordinals.stop - 1} (num_kv_tokens={num_kv_tokens}, B={tokens_per_block})"
            )
    missing = [i for i in ordinals if src_ordinals[i] == UNBOUND]
    if missing:
        raise KVSliceError(
            f"source has no page for ordinals {missing} inside the slice "
            f"[{ordinals.start}, {ordinals.stop}) (num_kv_tokens={num_kv_tokens}, window={window})"
        )
    return [(i, src_ordinals[i], dst_ordinals[i]) for i in ordinals if dst_ordinals[i] != UNBOUND]


def plan_pull(
    src_ordinals: Sequence[int],
    dst_ordinals: Sequence[int],
    cached_ordinals: Collection[int],
    num_kv_tokens: int,
    window: int | None,
    tokens_per_block: int,
) -> list[tuple[int, int, int]]:
    """``plan_slice`` with the receiver's ``cached_ordinals`` treated as ``-1`` in ``dst``.

    ``cached_ordinals`` names positions (block ``i`` = tokens ``[i*B, (i+1)*B)``),
    possibly with holes (an evicted block between two cached ones is pulled).
    Each must be bound in ``dst``: a cached ordinal without a page means the
    tables disagree, and KVSliceError is raised before anything is planned.
    """
    cached = set(cached_ordinals)
    unbound = sorted(i for i in cached if not 0 <= i < len(dst_ordinals) or dst_ordinals[i] == UNBOUND)
    if unbound:
        raise KVSliceError(f"cached ordinals {unbound} have no page in the destination table")
    receiving = [UNBOUND if i in cached else page for i, page in enumerate(dst_ordinals)]
    return plan_slice(src_ordinals, receiving, num_kv_tokens, window, tokens_per_block)
