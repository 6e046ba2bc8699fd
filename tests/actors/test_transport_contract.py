"""The KVTransport contract, run against every kind (nixl: two agents in one process)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.transport import LocalFabric, PageRun, TransferError, coalesce, make_transport

KINDS = ["local", "nixl"]
PEER_PAGES = {"full": 48, "swa": 24}   # the side we read from
OUR_PAGES = {"full": 40, "swa": 30}    # the side we write into


def _pages(num_pages: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_pages, 2, 2, 4, 2, 8, generator=gen).to(dtype)


def _tensors(num_pages: dict[str, int], seed: int) -> dict[str, torch.Tensor]:
    return {"full": _pages(num_pages["full"], torch.float32, seed),
            "swa": _pages(num_pages["swa"], torch.bfloat16, seed + 1)}


def _bytes(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(pages.shape[0], -1).view(torch.uint8)


def _make(kind: str, name: str, fabric: LocalFabric):
    return make_transport(kind, name, fabric=fabric) if kind == "local" else make_transport(kind, name)


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    """(reader, peer): reader has connected to peer; tensors are refilled per test."""
    fabric = LocalFabric()
    peer, reader = _make(request.param, "ctx-test", fabric), _make(request.param, "gen-test", fabric)
    peer.register(_tensors(PEER_PAGES, seed=1))
    reader.register(_tensors(OUR_PAGES, seed=2))
    reader.connect(peer.agent_name, peer.metadata())
    yield reader, peer
    reader.close()
    peer.close()


def _refill(transport, seed: int) -> None:
    """New random contents in the same (registered) memory."""
    for group, fresh in _tensors({g: t.shape[0] for g, t in transport.tensors.items()}, seed).items():
        transport.tensors[group].copy_(fresh)


def _snapshot(transport) -> dict[str, torch.Tensor]:
    return {g: t.clone() for g, t in transport.tensors.items()}


def _assert_unchanged(transport, before: dict[str, torch.Tensor]) -> None:
    for group, tensor in transport.tensors.items():
        assert torch.equal(_bytes(tensor), _bytes(before[group])), f"group {group} changed"


@st.composite
def page_pairs(draw, group: str):
    dsts = draw(st.lists(st.integers(0, OUR_PAGES[group] - 1), unique=True, max_size=OUR_PAGES[group]))
    srcs = draw(st.lists(st.integers(0, PEER_PAGES[group] - 1), min_size=len(dsts), max_size=len(dsts)))
    if draw(st.booleans()):  # also exercise long adjacent runs
        dsts, srcs = sorted(dsts), sorted(srcs)
    return list(zip(srcs, dsts))


@settings(max_examples=25, deadline=None)
@given(full=page_pairs("full"), swa=page_pairs("swa"), seed=st.integers(0, 2**16))
def test_read_copies_exactly_the_destination_pages(pair, full, swa, seed):
    reader, peer = pair
    _refill(peer, seed)
    _refill(reader, seed + 7)
    before = _snapshot(reader)
    runs = coalesce(full, "full") + coalesce(swa, "swa")

    stats = reader.read(peer.agent_name, runs)
    num_bytes = stats.num_bytes

    for group, pairs in (("full", full), ("swa", swa)):
        ours, theirs, old = _bytes(reader.tensors[group]), _bytes(peer.tensors[group]), _bytes(before[group])
        for src, dst in pairs:
            assert torch.equal(ours[dst], theirs[src]), f"{group}: page {dst} != peer page {src}"
        untouched = sorted(set(range(ours.shape[0])) - {dst for _, dst in pairs})
        assert torch.equal(ours[untouched], old[untouched])
    page_nbytes = {g: _bytes(t).shape[1] for g, t in reader.tensors.items()}
    assert num_bytes == len(full) * page_nbytes["full"] + len(swa) * page_nbytes["swa"]
    assert stats == reader.last_read
    assert (stats.num_reads, stats.num_descriptors, stats.num_pages) == (1, len(runs), len(full) + len(swa))


@pytest.mark.parametrize("run", [
    PageRun("full", src_page=PEER_PAGES["full"], dst_page=0, num_pages=1),       # src past the end
    PageRun("full", src_page=PEER_PAGES["full"] - 2, dst_page=0, num_pages=3),   # src run overhangs
    PageRun("full", src_page=0, dst_page=OUR_PAGES["full"] - 1, num_pages=2),    # dst run overhangs
    PageRun("swa", src_page=-1, dst_page=0, num_pages=1),
    PageRun("swa", src_page=0, dst_page=OUR_PAGES["swa"], num_pages=1),
    PageRun("nope", src_page=0, dst_page=0, num_pages=1),
], ids=["src-end", "src-overhang", "dst-overhang", "src-negative", "dst-end", "unknown-group"])
def test_bad_run_raises_and_changes_nothing(pair, run):
    reader, peer = pair
    before = _snapshot(reader)
    good = PageRun("full", src_page=0, dst_page=0, num_pages=4)  # a valid run in the same call
    with pytest.raises(TransferError):
        reader.read(peer.agent_name, [good, run])
    _assert_unchanged(reader, before)


def test_two_runs_into_one_page_raise(pair):
    reader, peer = pair
    before = _snapshot(reader)
    with pytest.raises(TransferError, match="written by two runs"):
        reader.read(peer.agent_name, [PageRun("full", 0, 5, 3), PageRun("full", 10, 7, 1)])
    _assert_unchanged(reader, before)


def test_unknown_peer_raises(pair):
    reader, _ = pair
    with pytest.raises(TransferError, match="unknown peer"):
        reader.read("nobody", [PageRun("full", 0, 0, 1)])


def test_adjacent_pages_go_out_as_one_descriptor(pair):
    reader, peer = pair
    pairs = [(i, i + 3) for i in range(32)]
    runs = coalesce(pairs, "full")
    assert len(runs) == 1
    reader.read(peer.agent_name, runs)
    assert (reader.last_read.num_pages, reader.last_read.num_descriptors) == (32, 1)


def test_connect_is_idempotent_and_disconnect_forgets(pair):
    reader, peer = pair
    reader.connect(peer.agent_name, peer.metadata())
    assert reader.read(peer.agent_name, [PageRun("swa", 0, 0, 1)]).num_bytes > 0
    reader.disconnect(peer.agent_name)
    with pytest.raises(TransferError, match="unknown peer"):
        reader.read(peer.agent_name, [PageRun("swa", 0, 0, 1)])
    reader.connect(peer.agent_name, peer.metadata())
    assert reader.read(peer.agent_name, [PageRun("swa", 0, 0, 1)]).num_bytes > 0


def test_notifications_arrive_in_order_from_connected_peers(pair):
    reader, peer = pair
    peer.connect(reader.agent_name, reader.metadata())
    for i in range(3):
        reader.send_notif(peer.agent_name, f"ask|{i}".encode())
    peer.send_notif(reader.agent_name, b"re|0")
    arrived = _collect(peer, 3)
    assert arrived == [(reader.agent_name, f"ask|{i}".encode()) for i in range(3)]
    assert _collect(reader, 1) == [(peer.agent_name, b"re|0")]
    with pytest.raises(TransferError, match="unknown peer"):
        reader.send_notif("nobody", b"hello")


def _collect(transport, count: int, timeout_s: float = 5.0) -> list[tuple[str, bytes]]:
    arrived, deadline = [], time.monotonic() + timeout_s
    while len(arrived) < count and time.monotonic() < deadline:
        arrived += transport.get_notifs()
        time.sleep(0.001)
    return arrived


def test_metadata_for_another_name_is_rejected(pair):
    reader, peer = pair
    with pytest.raises(TransferError, match="metadata is for agent"):
        reader.connect("someone-else", peer.metadata())


def test_nixl_merges_each_run_into_one_wire_descriptor():
    pytest.importorskip("nixl._api")
    peer, reader = (make_transport("nixl", n, capture_telemetry=True) for n in ("ctx-tel", "gen-tel"))
    try:
        peer.register(_tensors(PEER_PAGES, seed=3))
        reader.register(_tensors(OUR_PAGES, seed=4))
        reader.connect(peer.agent_name, peer.metadata())
        runs = coalesce([(i, i) for i in range(20)] + [(30, 25), (31, 26), (2, 30)], "full")
        reader.read(peer.agent_name, runs)
        assert reader.last_read.num_pages == 23
        assert reader.last_nixl_descriptors == len(runs) == 3
    finally:
        reader.close()
        peer.close()


def test_target_without_progress_times_out():
    """NIXL completes a READ only when the target's worker progresses: no thread, no completion."""
    pytest.importorskip("nixl._api")
    peer = make_transport("nixl", "ctx-stalled", progress_delay_us=None)
    reader = make_transport("nixl", "gen-waiting", progress_delay_us=None)
    try:
        peer.register(_tensors(PEER_PAGES, seed=5))
        reader.register(_tensors(OUR_PAGES, seed=6))
        reader.connect(peer.agent_name, peer.metadata())
        with pytest.raises(TransferError, match="timed out after 0.3s"):
            reader.read(peer.agent_name, [PageRun("full", 0, 0, 4)], timeout_s=0.3)
    finally:
        reader.close()
        peer.close()


def test_unknown_kind_is_a_value_error():
    with pytest.raises(ValueError, match="unknown transport kind 'carrier-pigeon'"):
        make_transport("carrier-pigeon", "x")


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=40))
def test_coalesce_round_trips_and_is_maximal(pairs):
    runs = coalesce(pairs, "g")
    assert [p for run in runs for p in run.pairs()] == pairs
    for a, b in zip(runs, runs[1:]):
        assert (b.src_page, b.dst_page) != (a.src_page + a.num_pages, a.dst_page + a.num_pages)
