"""N-gram (prompt lookup) drafter and the drafter factory."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.drafter import NgramDrafter, make_drafter


def _reference_propose(tokens, max_len, min_ngram, max_ngram):
    """Brute force: longest n first, then the most recent earlier match."""
    for n in range(max_ngram, min_ngram - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                return tokens[start + n : start + n + max_len]
    return []


def _is_true_continuation(tokens, proposal, min_ngram, max_ngram):
    """Some earlier occurrence of a suffix n-gram is followed by exactly ``proposal``."""
    length = len(tokens)
    return any(
        tokens[start : start + n] == tokens[length - n :]
        and tokens[start + n : start + n + len(proposal)] == proposal
        for n in range(min_ngram, max_ngram + 1)
        for start in range(length - n)
    )


histories = st.lists(st.integers(0, 3), max_size=60)
ngram_ranges = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=300, deadline=None)
@given(
    tokens=histories,
    max_len=st.integers(0, 8),
    max_draft_len=st.integers(1, 6),
    ngrams=ngram_ranges,
)
def test_proposal_is_a_true_continuation(tokens, max_len, max_draft_len, ngrams):
    min_ngram, max_ngram = ngrams
    drafter = NgramDrafter(max_draft_len, min_ngram, max_ngram)
    proposal = drafter.propose(tokens, max_len)
    assert len(proposal) <= min(max_len, max_draft_len)
    if proposal:
        assert _is_true_continuation(tokens, proposal, min_ngram, max_ngram)
    limit = min(max_len, max_draft_len)
    assert proposal == _reference_propose(tokens, limit, min_ngram, max_ngram)
    assert drafter.propose(tuple(tokens), max_len) == proposal  # any sequence, not only lists


@settings(max_examples=200, deadline=None)
@given(
    period=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    extra=st.integers(0, 30),
    max_len=st.integers(1, 8),
)
def test_periodic_history_is_continued_by_the_period(period, extra, max_len):
    max_ngram = 4  # >= the period, so the matched n-gram fixes the phase
    length = max_ngram + len(period) + extra
    tokens = [period[i % len(period)] for i in range(length)]
    proposal = NgramDrafter(8, 1, max_ngram).propose(tokens, max_len)
    assert proposal
    assert proposal == [period[(length + i) % len(period)] for i in range(len(proposal))]


def test_prefers_the_longest_ngram_then_the_most_recent_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [7, 1, 2, 5, 9, 2, 6, 3, 1, 2]
    # suffix [1, 2] matches at 1 (then 5, 9); the later single [2] at 5 (then 6) loses.
    assert NgramDrafter(4, 1, 3).propose(tokens, 4) == [5, 9, 2, 6]
    # with bigrams off, the most recent earlier [2] wins.
    assert NgramDrafter(4, 1, 1).propose(tokens, 4) == [6, 3, 1, 2]


def test_proposal_stops_where_the_history_ends():
    assert NgramDrafter(8).propose([4, 5, 6, 4, 5], 8) == [6, 4, 5]


def test_no_match_or_no_room_proposes_nothing():
    drafter = NgramDrafter(4)
    assert drafter.propose([], 4) == []
    assert drafter.propose([3], 4) == []
    assert drafter.propose([1, 2, 3, 4], 4) == []
    assert drafter.propose([1, 2, 1], 0) == []
    assert NgramDrafter(4, min_ngram=2).propose([1, 2, 3, 1], 4) == []


def test_max_draft_len_caps_the_proposal():
    assert NgramDrafter(2).propose([1, 2, 3, 4, 5, 1], 10) == [2, 3]


def test_long_history_stays_cheap():
    """Called every decode step: a 4k-token history must not cost quadratic time."""
    rng = random.Random(0)
    tokens = [rng.randrange(32_000) for _ in range(4096)]
    drafter = NgramDrafter(5)
    start = time.perf_counter()
    for _ in range(50):
        drafter.propose(tokens, 5)
    assert (time.perf_counter() - start) / 50 < 0.02  # quadratic Python is ~1 s per call


def test_drafters_declare_extra_kv_tokens():
    assert NgramDrafter(3).num_extra_kv_tokens == 0


@pytest.mark.parametrize(
    "args", [(0,), (3, 0), (3, 3, 2)], ids=["no-drafts", "zero-ngram", "min-above-max"]
)
def test_ngram_drafter_rejects_bad_config(args):
    with pytest.raises(ValueError):
        NgramDrafter(*args)


def test_make_drafter():
    drafter = make_drafter("ngram", 4, min_ngram=2, max_ngram=5)
    assert isinstance(drafter, NgramDrafter)
    assert drafter.max_draft_len == 4
    assert drafter.propose([1, 2, 3, 1, 2], 4) == [3, 1, 2]
    assert make_drafter("none", 4) is None
    with pytest.raises(ValueError, match="ngram, none"):
        make_drafter("eagle", 4)
