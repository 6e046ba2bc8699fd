"""The KV-aware router's cost and ranking, on replicas described by their routing stats."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.routing import CostScales, ReplicaView, RoutingHint, rank_replicas
from kvcache import BlockSummary, block_hashes, stale_end

B = 16
WINDOWS = {"full": None, "sliding": 64}
FINGERPRINT = b"model-a"
SCALES = CostScales(prefill_load_scale=1.0, decode_load_scale=64.0)


def prompt_hint(num_tokens: int = 1000, seed: int = 0) -> RoutingHint:
    tokens = [(seed * 7919 + i * 31) % 50_000 for i in range(num_tokens)]
    return RoutingHint(f"req-{seed}", num_tokens, tuple(block_hashes(tokens, B, FINGERPRINT)), FINGERPRINT)


def replica(name: str, cached: dict[str, list[bytes]] | None = None, *, free: int = 1000, queued: int = 0,
            running: int = 0, fingerprint: bytes = FINGERPRINT, reported: bool = True, empty: int | None = None):
    if not reported:
        return SimpleNamespace(name=name, routing_stats={})
    cached = cached or {g: [] for g in WINDOWS}
    stats = {
        "num_free_pages": free, "num_empty_pages": free if empty is None else empty, "num_total_pages": 1000,
        "num_running": running, "num_waiting": 0,
        "queued_prefill_tokens": queued, "tokens_per_block": B, "kv_fingerprint": fingerprint,
        "windows": WINDOWS, "cache_summaries": {g: BlockSummary.of(cached[g], 500).to_bytes() for g in WINDOWS},
    }
    return SimpleNamespace(name=name, routing_stats=stats)


def order(replicas, hint, queue=None) -> list[str]:
    queue = queue or {}
    ranks = rank_replicas(replicas, hint, lambda r: queue.get(r.name), SCALES)
    return [r.name for rank in ranks for r in rank]


def holding(hint: RoutingHint, num_blocks: int) -> dict[str, list[bytes]]:
    return {g: list(hint.block_hashes[:num_blocks]) for g in WINDOWS}


def test_the_replica_holding_the_prefix_wins():
    hint = prompt_hint()
    ranked = order([replica("cold"), replica("warm", holding(hint, 60)), replica("lukewarm", holding(hint, 20))], hint)
    assert ranked == ["warm", "lukewarm", "cold"]
    assert ReplicaView.from_stats(replica("warm", holding(hint, 60)).routing_stats).hit(hint) == 960


def test_a_long_prefill_queue_outweighs_the_cache():
    hint = prompt_hint()
    busy_warm = replica("busy-warm", holding(hint, 60), queued=5000)
    assert order([busy_warm, replica("cold")], hint) == ["cold", "busy-warm"]


def test_ongoing_requests_count_against_a_replica():
    hint = prompt_hint(num_tokens=64)
    assert order([replica("a"), replica("b")], hint, queue={"a": 3, "b": 0}) == ["b", "a"]


def test_a_full_cache_is_avoided_even_when_it_holds_the_prefix():
    hint = prompt_hint()
    full_warm = replica("full-warm", holding(hint, 30), free=10)  # 28 blocks x 2 groups to bind, 10 free
    assert order([full_warm, replica("cold", queued=2000)], hint) == ["cold", "full-warm"]


def test_only_the_stale_head_of_a_window_group_earns_nothing_past_it():
    """Both replicas hold blocks 0..59 of the full group; in the window group (W=64, 4 blocks)
    one holds the head 0..3, the other 56..59. A hit at 960 needs window blocks
    stale_end(960) = 56 .. 59: only the second replica gets it."""
    hint = prompt_hint()
    head = {"full": list(hint.block_hashes[:60]), "sliding": list(hint.block_hashes[:4])}
    tail = {"full": list(hint.block_hashes[:60]), "sliding": list(hint.block_hashes[56:60])}
    views = {n: ReplicaView.from_stats(replica(n, c).routing_stats) for n, c in (("head", head), ("tail", tail))}
    assert views["tail"].hit(hint) == 960
    assert views["head"].hit(hint) == 64  # the largest h whose window blocks (0..3) it holds
    assert order([replica("head", head), replica("tail", tail)], hint) == ["tail", "head"]


def test_another_models_summary_earns_no_hit():
    hint = prompt_hint()
    other = replica("other", holding(hint, 60), fingerprint=b"model-b")
    assert ReplicaView.from_stats(other.routing_stats).hit(hint) == 0


def test_unreported_replicas_rank_last_and_no_hint_means_load_only():
    hint = prompt_hint()
    ranked = rank_replicas([replica("new", reported=False), replica("a"), replica("b", running=2)], None,
                           lambda r: None, SCALES)
    assert [[r.name for r in rank] for rank in ranked] == [["a"], ["b"], ["new"]]
    assert order([replica("new", reported=False), replica("a")], hint)[-1] == "new"


def test_scales_are_validated():
    with pytest.raises(ValueError):
        CostScales(prefill_load_scale=-1)


def test_a_receiver_is_credited_with_the_slice_blocks_it_holds():
    """A transfer skips held slice ordinals: a replica holding the prefix's full-group blocks but,
    in the window group, only the slice of an earlier, longer prompt (its stale head released)
    gets no prefix hit, yet saves the full group's pages when receiving."""
    hint = prompt_hint()  # P = 1000, 62 full blocks; window slice = ordinals 59..62
    held = {"full": list(hint.block_hashes[:60]), "sliding": []}
    view = ReplicaView.from_stats(replica("g", held).routing_stats)
    transfer = dataclasses.replace(hint, is_transfer=True)
    assert view.hit(hint) == 0  # computing the prompt here would need window blocks 56..59
    slice_blocks = 63 + (63 - stale_end(1000, 64, B))
    assert view.hit(transfer) == 1000 * 60 // slice_blocks
    assert order([replica("cold"), replica("g", held)], transfer) == ["g", "cold"]


def test_among_equal_costs_the_replica_with_the_most_empty_pages_wins():
    """A prompt nobody holds, no queues: the replica whose free pages hold no cached block ranks
    first; a replica holding the prefix still beats an emptier one."""
    hint = prompt_hint()
    ranked = order([replica("a", empty=10), replica("b", empty=300), replica("c", empty=50)], hint)
    assert ranked == ["b", "c", "a"]
    assert order([replica("empty", empty=1000), replica("warm", holding(hint, 30), empty=0)], hint)[0] == "warm"
    assert order([replica("empty", empty=1000), replica("idle", empty=0)], hint, queue={"empty": 1}) == [
        "idle", "empty"]  # load still counts first


@settings(max_examples=60, deadline=None)
@given(num_replicas=st.integers(2, 5), num_conversations=st.integers(1, 40),
       lengths=st.lists(st.integers(1, 40), min_size=40, max_size=40))
def test_new_conversations_spread_by_cache_footprint(num_replicas, num_conversations, lengths):
    """Conversations arrive one at a time (low load), each a prompt no replica holds, of
    ``lengths[c]`` blocks that stay cached where it ran. Every placement goes to a replica with
    the fewest cached pages, so no replica caches more than another by more than one prompt
    (a random spread overfills one cache while another stands empty)."""
    pages = 1000
    cached = {f"r{i}": 0 for i in range(num_replicas)}
    for c in range(num_conversations):
        hint = prompt_hint(num_tokens=lengths[c] * B, seed=c + 1)
        replicas = [replica(n, empty=pages - used) for n, used in cached.items()]
        first = order(replicas, hint)[0]
        assert cached[first] == min(cached.values())
        cached[first] += lengths[c]
    assert max(cached.values()) - min(cached.values()) <= max(lengths[:num_conversations])


def test_a_live_empty_queue_outweighs_a_stale_report_of_queued_prefills():
    """After a burst, the report (a period old) still shows the holder's queued prefills; Serve's live
    count says nothing is there any more: the repeat goes to the holder. While Serve counts requests
    there, the queued tokens count as reported."""
    hint = prompt_hint(1000)
    holder, other = replica("holder", holding(hint, 60), queued=5000), replica("other")
    assert order([holder, other], hint, {"holder": 0, "other": 0}) == ["holder", "other"]
    assert order([holder, other], hint, {"holder": 2, "other": 0}) == ["other", "holder"]
    assert order([holder, other], hint) == ["other", "holder"]  # no live count: the report decides
