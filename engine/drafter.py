"""Speculative drafters: cheap guesses of the next tokens, verified by the model.

Every drafter declares ``num_extra_kv_tokens``, the KV slots it needs beyond
the prompt and the drafts (0 for drafters that run no model); capacity comes
from ``get_kv_capacity_tokens`` with that number, never by hand.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    """What the generation worker asks of a drafter."""

    @property
    def num_extra_kv_tokens(self) -> int: ...

    @property
    def max_draft_len(self) -> int: ...

    def propose(self, token_ids: Sequence[int], max_len: int) -> list[int]: ...


class NgramDrafter:
    """Prompt-lookup drafting: copy what followed the last n-gram the last time.

    For ``n`` from ``max_ngram`` down to ``min_ngram``, look for the most
    recent earlier occurrence of the last ``n`` tokens and propose the tokens
    that followed it. With ``L = len(token_ids)`` and the match at ``j``::

        token_ids:  ... [j, j+n) ............ [L-n, L)
                         match  [j+n, ...)     suffix
                                proposal (up to max_len, stops at L)

    ``j`` ranges over ``[0, L-n-1]`` so that at least one token follows the
    match; the proposal may run into the suffix itself (periodic text).
    """

    def __init__(self, max_draft_len: int, min_ngram: int = 1, max_ngram: int = 3) -> None:
        if max_draft_len < 1:
            raise ValueError(f"max_draft_len must be >= 1, got {max_draft_len}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self._max_draft_len = max_draft_len
        self._min_ngram = min_ngram
        self._max_ngram = max_ngram

    @property
    def num_extra_kv_tokens(self) -> int:
        return 0

    @property
    def max_draft_len(self) -> int:
        return self._max_draft_len

    def propose(self, token_ids: Sequence[int], max_len: int) -> list[int]:
        """Up to ``min(max_len, max_draft_len)`` tokens, ``[]`` if no n-gram matches.

        ``token_ids`` is the prompt plus everything generated so far; read, never kept.
        Runs for every drafting request at every step, so it is plain Python: one scan
        for the positions that hold the last token (where any match must end), then
        the longer suffixes checked at those positions only, latest first. Linear in
        the history.
        """
        max_len = min(max_len, self._max_draft_len)
        length = len(token_ids)
        if max_len <= 0 or length < 2:
            return []
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        last = tokens[-1]
        ends = [p for p, token in enumerate(tokens[:-1]) if token == last]
        for n in range(min(self._max_ngram, length - 1), self._min_ngram - 1, -1):
            suffix = tokens[length - n:]
            for end in reversed(ends):
                if end >= n - 1 and tokens[end - n + 1:end + 1] == suffix:
                    return tokens[end + 1:end + 1 + max_len]
        return []


_DRAFTERS = {"ngram": NgramDrafter}


def make_drafter(kind: str, max_draft_len: int, **kwargs) -> Drafter | None:
    """Build the drafter named ``kind``; ``"none"`` means no speculation (None).

    ``kwargs`` go to the drafter's constructor (e.g. ``min_ngram`` for
    ``"ngram"``). Unknown kinds raise ValueError naming the known ones.
    """
    if kind == "none":
        return None
    if kind not in _DRAFTERS:
        known = ", ".join(sorted([*_DRAFTERS, "none"]))
        raise ValueError(f"unknown drafter kind {kind!r}; known kinds: {known}")
    return _DRAFTERS[kind](max_draft_len, **kwargs)
