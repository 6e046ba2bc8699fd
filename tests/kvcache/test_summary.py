"""BlockSummary: no false negatives, the stated false-positive rate, a wire form, and window-aware hits."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import BlockSummary, block_hashes, hit_for_windows

NAMES = st.lists(st.binary(min_size=16, max_size=16), min_size=1, max_size=200, unique=True)


@settings(max_examples=100, deadline=None)
@given(names=NAMES, capacity=st.integers(1, 400))
def test_every_added_name_is_found(names, capacity):
    summary = BlockSummary.of(names, capacity)
    assert all(name in summary for name in names)
    again = BlockSummary.from_bytes(summary.to_bytes())
    assert all(name in again for name in names)
    assert again.to_bytes() == summary.to_bytes()


def test_false_positive_rate_is_near_the_target_at_capacity():
    capacity, target = 5000, 0.01
    summary = BlockSummary.of((os.urandom(16) for _ in range(capacity)), capacity, target)
    trials = 40_000
    false_positives = sum(os.urandom(16) in summary for _ in range(trials))
    assert false_positives / trials < 2 * target
    assert abs(summary.false_positive_rate(capacity) - target) < 0.003
    # Bounded size: ~9.6 bits a page, whatever the pages hold.
    assert len(summary.to_bytes()) < capacity * 10 / 8 + 16


def test_empty_summary_holds_nothing():
    summary = BlockSummary.for_capacity(64)
    assert os.urandom(16) not in summary
    assert "not bytes" not in summary


def test_router_hit_is_window_aware():
    """B=8, W=16, prompt of 40 tokens: blocks 0..3 named. A replica whose window group holds
    only the stale head (blocks 0, 1) gets no hit at 32; one that holds 2, 3 gets 32."""
    B, windows = 8, {"full": None, "sliding": 16}
    names = block_hashes(list(range(40)), B)
    full = BlockSummary.of(names[:4], 64)
    head = {"full": full, "sliding": BlockSummary.of(names[:2], 64)}
    tail = {"full": full, "sliding": BlockSummary.of(names[2:4], 64)}
    assert hit_for_windows(windows, B, tail, names, 40) == 32
    # Counting matching blocks would credit the head replica with 2 window blocks as well; by
    # positions, a query at 32 reads blocks 2 and 3, so the best it allows is h = 16 (blocks 0, 1).
    assert hit_for_windows(windows, B, head, names, 40) == 16
