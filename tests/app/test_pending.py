"""The router counts its own decisions (app.pending): a burst of new prefixes within one report
period spreads by what each replica will hold; a report that shows a request supersedes it."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from app.pending import PENDING_MAX_AGE_S, PendingDecisions, with_pending
from app.routing import KVAwareRequestRouter, ReplicaView, RoutingHint, rank_replicas
from kvcache import block_hashes, stale_end
from tests.app.test_routing import FINGERPRINT, SCALES, WINDOWS, B, prompt_hint, replica


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tokens(seed: int, num_tokens: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50_000 for i in range(num_tokens)]


def hint_of(request_id: str, token_ids: list[int], is_transfer: bool = False) -> RoutingHint:
    return RoutingHint(request_id, len(token_ids), tuple(block_hashes(token_ids, B, FINGERPRINT)), FINGERPRINT,
                       is_transfer)


def send(replicas, hint: RoutingHint, decisions: PendingDecisions) -> str:
    """One routing decision as KVAwareRequestRouter makes it: rank, take the first, count it."""
    def pending_of(r, view: ReplicaView):
        decisions.reconcile(r.name, view.accounted_ids)
        return decisions.hints(r.name)

    first = rank_replicas(replicas, hint, lambda r: None, SCALES, pending_of)[0][0]
    decisions.add(first.name, hint)
    return first.name


def test_a_burst_of_new_prefixes_spreads_by_what_each_replica_will_hold():
    """Reports stay as they were before the burst (one period behind): r0 500 empty pages, r1 480.
    Each prefix is 20 full blocks x 2 groups = 40 pages. Counting its own decisions, the router
    alternates r0, r1, r0, ... (500 > 480, then 460 < 480, 460 > 440, ...); repeats of each prefix
    (a new question after it) follow it. On reports alone every prefix went to r0."""
    replicas = [replica("r0", empty=500), replica("r1", empty=480)]
    prefixes = [tokens(seed, 20 * B) for seed in range(1, 7)]
    decisions = PendingDecisions()
    placed = [send(replicas, hint_of(f"first-{i}", p + tokens(100 + i, 5)), decisions) for i, p in enumerate(prefixes)]
    assert placed == ["r0", "r1"] * 3
    for question in range(3):
        repeats = [send(replicas, hint_of(f"q{question}-{i}", p + tokens(200 + 10 * i + question, 7)), decisions)
                   for i, p in enumerate(prefixes)]
        assert repeats == placed
    on_reports_alone = [rank_replicas(replicas, hint_of(f"x{i}", p), lambda r: None, SCALES)[0][0].name
                        for i, p in enumerate(prefixes)]
    assert on_reports_alone == ["r0"] * 6


@settings(max_examples=40, deadline=None)
@given(num_replicas=st.integers(2, 4), lengths=st.lists(st.integers(1, 30), min_size=1, max_size=12),
       empty=st.lists(st.integers(100, 1000), min_size=4, max_size=4))
def test_each_new_prefix_goes_where_the_most_empty_pages_will_be(num_replicas, lengths, empty):
    """Stale reports, new prefixes of ``lengths[i]`` blocks: each lands on a replica with the most
    empty pages once the earlier ones of the burst are counted (2 groups: 2 pages a block)."""
    names = [f"r{i}" for i in range(num_replicas)]
    replicas = [replica(n, empty=empty[i]) for i, n in enumerate(names)]
    will_be_empty = dict(zip(names, empty))
    decisions = PendingDecisions()
    for i, num_blocks in enumerate(lengths):
        chosen = send(replicas, hint_of(f"p{i}", tokens(i + 1, num_blocks * B + 3)), decisions)
        assert will_be_empty[chosen] == max(will_be_empty.values())
        will_be_empty[chosen] = max(0, will_be_empty[chosen] - 2 * num_blocks)


def test_a_report_that_shows_the_request_supersedes_it():
    """Pending on r0: r0 is credited the prefix and 2 x 20 pages less. Once r0's report lists the
    request (here: its blocks already evicted there, no summary entry), r0 gets neither."""
    prefix = tokens(1, 20 * B)
    decisions = PendingDecisions()
    decisions.add("r0", hint_of("first", prefix + [7]))
    view = ReplicaView.from_stats(replica("r0", empty=500).routing_stats)
    repeat = hint_of("repeat", prefix + [8, 9])
    pending = with_pending(view, decisions.hints("r0"))
    assert (pending.hit(repeat), pending.num_empty_pages, pending.num_free_pages) == (20 * B, 460, 960)
    decisions.reconcile("r0", frozenset({"some-other-request"}))
    assert decisions.hints("r0") != []  # a report that does not show it changes nothing
    shown = ReplicaView.from_stats(replica("r0", empty=500).routing_stats | {"accounted_request_ids": ["first"]})
    decisions.reconcile("r0", shown.accounted_ids)
    after = with_pending(shown, decisions.hints("r0"))
    assert decisions.hints("r0") == []
    assert (after.hit(repeat), after.num_empty_pages, after.num_free_pages) == (0, 500, 1000)


def test_blocks_the_report_already_holds_take_no_pages_twice():
    """A pending request whose blocks the report already shows (cached before the report listed it)
    takes no pages from the view; two pending requests sharing a prefix count its pages once."""
    prefix = tokens(1, 20 * B)
    held = {g: list(block_hashes(prefix, B, FINGERPRINT)) for g in WINDOWS}
    view = ReplicaView.from_stats(replica("r0", held, empty=500).routing_stats)
    assert with_pending(view, [hint_of("a", prefix + [1])]).num_empty_pages == 500
    cold = ReplicaView.from_stats(replica("r1", empty=500).routing_stats)
    two = with_pending(cold, [hint_of("a", prefix + [1]), hint_of("b", prefix + tokens(9, 2 * B))])
    assert two.num_empty_pages == 500 - 2 * 22  # 20 shared blocks + b's 2 more, in 2 groups


def test_a_pending_entry_expires_when_no_report_ever_shows_it():
    clock = Clock()
    decisions = PendingDecisions(clock)
    decisions.add("r0", hint_of("lost", tokens(1, 3 * B)))
    clock.now = PENDING_MAX_AGE_S - 1
    decisions.reconcile("r0", frozenset())
    assert [h.request_id for h in decisions.hints("r0")] == ["lost"]
    clock.now = PENDING_MAX_AGE_S + 1
    decisions.reconcile("r0", frozenset())
    assert decisions.hints("r0") == []
    decisions.add("gone", hint_of("x", tokens(2, 3 * B)))
    decisions.retain(["r0"])
    assert decisions.hints("gone") == []


def test_a_pending_transfer_credits_no_stale_head():
    """P = 1000 (62 full blocks), W = 64 (4 blocks). A transfer to r0 takes the full group's 0..61
    but only the window slice 58..61: the stale head never travels. A prompt sharing the first
    40 blocks then needs, at any hit h = 16k, window blocks k-4..k-1 of its own: none held, so
    its hit there is 0 (a count of matching blocks would credit 640). Had r0 computed the prompt
    (not a transfer), both groups hold 0..61 and the hit is 640."""
    first = tokens(1, 1000)
    assert stale_end(1000, WINDOWS["sliding"], B) == 58
    second = first[:40 * B] + tokens(2, 1000 - 40 * B)
    view = ReplicaView.from_stats(replica("r0").routing_stats)
    transfer = hint_of("t", first, is_transfer=True)
    received = with_pending(view, [transfer])
    assert received.hit(hint_of("s", second)) == 0
    assert received.num_empty_pages == 1000 - 62 - 4
    # it holds the slice's 62 + 4 named blocks of 63 + 5 (block 62, partial, has no name: it always travels)
    assert received.hit(transfer) == 1000 * 66 // 68
    computed = with_pending(view, [dataclasses.replace(transfer, is_transfer=False)])
    assert computed.hit(hint_of("s", second)) == 640
    assert computed.num_empty_pages == 1000 - 2 * 62


def test_hints_of_another_model_are_not_counted():
    view = ReplicaView.from_stats(replica("r0").routing_stats)
    other = dataclasses.replace(prompt_hint(), fingerprint=b"model-b")
    assert with_pending(view, [other]) == view


def router_with_queue_lens(queue_lens: dict[str, int]) -> KVAwareRequestRouter:
    """The Serve router class itself, without Serve around it: its state and its decisions."""
    router = object.__new__(KVAwareRequestRouter)
    router._replica_queue_len_cache = SimpleNamespace(get=queue_lens.get)
    router.initialize_state()
    return router


def request(hint: RoutingHint, method: str = "prefill") -> SimpleNamespace:
    return SimpleNamespace(kwargs={"hint": hint}, metadata=SimpleNamespace(call_method=method))


def test_the_router_counts_a_choice_when_it_makes_it_not_when_serve_reports_it_routed():
    """Serve chooses for every request of a burst before the first acceptance comes back
    (``on_request_routed``, a round trip later). Counted at the choice, 6 new prefixes on 3 replicas
    with equal queues spread 2, 2, 2; counted only on acceptance, all 6 went to r0 (the most empty
    pages in the reports, 1000 vs 990 and 980). An acceptance elsewhere (the first choice was full)
    moves the request's blocks to where it went."""
    replicas = [SimpleNamespace(replica_id=f"r{i}", routing_stats=replica(f"r{i}", empty=1000 - 10 * i).routing_stats)
                for i in range(3)]
    router = router_with_queue_lens({f"r{i}": 1 for i in range(3)})
    hints = [hint_of(f"new-{i}", tokens(40 + i, 20 * B)) for i in range(6)]
    chosen = [asyncio.run(router.choose_replicas(replicas, request(h)))[0][0].replica_id for h in hints]
    assert sorted(chosen.count(f"r{i}") for i in range(3)) == [2, 2, 2], chosen
    moved_to = next(r for r in ("r0", "r1", "r2") if r != chosen[0])
    router.on_request_routed(request(hints[0]), moved_to, None)
    assert "new-0" in [h.request_id for h in router.pending.hints(moved_to)]
    assert "new-0" not in [h.request_id for h in router.pending.hints(chosen[0])]
    assert router.recent.owner[hints[0].block_hashes[0]] == moved_to
    repeat = hint_of("q-0", tokens(40, 20 * B) + tokens(99, 5))  # new-0's question follows it where it went
    assert asyncio.run(router.choose_replicas(replicas, request(repeat)))[0][0].replica_id == moved_to
