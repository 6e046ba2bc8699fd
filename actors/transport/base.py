"""The KV transport contract: pull pages of a peer's page tensors into ours.

Both sides register one tensor per layer group (``kvcache.spec``'s layout),
so page ``p`` of group ``g`` is the byte range::

    base[g] + p * page_nbytes[g]  ..  base[g] + (p + 1) * page_nbytes[g]

A read is described by ``PageRun``s. ``coalesce`` turns per-ordinal
(src_page, dst_page) pairs into maximal runs where both sides advance by one::

    pairs  (4,10) (5,11) (6,12) (9,13) (3,14)
    runs   PageRun(src=4, dst=10, n=3)  PageRun(src=9, dst=13, n=1)  PageRun(src=3, dst=14, n=1)

and each run is one transfer descriptor of ``num_pages * page_nbytes`` bytes.
Every run is checked against both sides' ``num_pages`` before anything is
posted, so a rejected read changes nothing.
"""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class TransferError(RuntimeError):
    """A read failed, timed out, or was rejected (unknown peer, bad page ids)."""


class PeerUnreachable(TransferError):
    """The peer did not take part: a connection, notification or read that failed or timed out
    once posted, as when its process died. A rejected read (bad page ids, a peer we never
    connected) is a plain ``TransferError``: retrying elsewhere would not fix the caller."""


@dataclass(frozen=True)
class PageRun:
    """Pages ``src_page .. src_page+num_pages-1`` of the peer -> ``dst_page ..`` of ours."""

    group: str
    src_page: int
    dst_page: int
    num_pages: int

    def __post_init__(self) -> None:
        if self.num_pages < 1:
            raise ValueError(f"PageRun needs num_pages >= 1, got {self.num_pages}")

    def pairs(self) -> list[tuple[int, int]]:
        return [(self.src_page + i, self.dst_page + i) for i in range(self.num_pages)]


def coalesce(pairs: list[tuple[int, int]], group: str) -> list[PageRun]:
    """Merge (src_page, dst_page) pairs, in the given order, into maximal runs."""
    runs: list[PageRun] = []
    for src, dst in pairs:
        last = runs[-1] if runs else None
        if last and src == last.src_page + last.num_pages and dst == last.dst_page + last.num_pages:
            runs[-1] = PageRun(group, last.src_page, last.dst_page, last.num_pages + 1)
        else:
            runs.append(PageRun(group, src, dst, 1))
    return runs


@dataclass(frozen=True)
class GroupRegion:
    """Where one group's pages live in a process: enough for a peer to address them."""

    base: int
    page_nbytes: int
    num_pages: int
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> GroupRegion:
        if not tensor.is_contiguous() or tensor.dim() < 1 or tensor.shape[0] < 1:
            raise ValueError("page tensors must be contiguous with at least one page")
        return cls(tensor.data_ptr(), tensor[0].numel() * tensor.element_size(), tensor.shape[0], str(tensor.device))


@dataclass(frozen=True)
class TransportMetadata:
    """What ``KVTransport.metadata()`` serializes: agent blob + per-group regions."""

    agent_name: str
    regions: dict[str, GroupRegion]
    agent_blob: bytes = b""

    def to_bytes(self) -> bytes:
        header = json.dumps({
            "agent_name": self.agent_name,
            "regions": {g: vars(r) for g, r in self.regions.items()},
        }).encode()
        return struct.pack("<I", len(header)) + header + self.agent_blob

    @classmethod
    def from_bytes(cls, data: bytes) -> TransportMetadata:
        try:
            (header_len,) = struct.unpack_from("<I", data)
            header = json.loads(data[4:4 + header_len])
        except (struct.error, ValueError) as e:
            raise TransferError(f"malformed transport metadata: {e}") from e
        regions = {g: GroupRegion(**r) for g, r in header["regions"].items()}
        return cls(header["agent_name"], regions, bytes(data[4 + header_len:]))


@dataclass(frozen=True)
class ReadStats:
    """One read, or a sum of reads: pages before coalescing, descriptors (runs) after.

    The one record of what moved: ``read`` returns it, the generation worker
    returns it from ``receive_kv``, and ``total`` sums it for metrics.
    ``seconds`` is the read alone, from posting to completion.
    """

    num_descriptors: int = 0
    num_pages: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    num_reads: int = 0

    def __add__(self, other: ReadStats) -> ReadStats:
        return ReadStats(self.num_descriptors + other.num_descriptors, self.num_pages + other.num_pages,
                         self.num_bytes + other.num_bytes, self.seconds + other.seconds,
                         self.num_reads + other.num_reads)


def unique_agent_name(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


class KVTransport(ABC):
    """Pull-only page mover. Subclasses implement the ``_``-prefixed hooks.

    State: ``register`` fixes our regions (once); ``connect`` adds a peer;
    ``read`` changes only our destination pages named in its runs, and only
    when every run validates; ``last_read`` / ``total`` report what moved.
    ``send_notif`` / ``get_notifs`` carry small control messages between
    connected agents (the control channel), separate from reads.
    """

    def __init__(self, agent_name: str) -> None:
        self.agent_name = agent_name
        self.tensors: dict[str, torch.Tensor] = {}
        self.regions: dict[str, GroupRegion] = {}
        self.peers: dict[str, TransportMetadata] = {}
        self.last_read: ReadStats | None = None
        self.total = ReadStats()
        self._stats_lock = threading.Lock()

    def register(self, tensors: dict[str, torch.Tensor]) -> None:
        """Register the page tensor of every group. Once per transport."""
        if self.tensors:
            raise RuntimeError(f"{self.agent_name}: page tensors are already registered")
        if not tensors:
            raise ValueError("register needs at least one group tensor")
        if len({t.device for t in tensors.values()}) != 1:
            raise ValueError("all group tensors must live on one device")
        self.regions = {g: GroupRegion.of(t) for g, t in tensors.items()}
        self.tensors = dict(tensors)
        self._register(self.tensors)

    def metadata(self) -> bytes:
        if not self.tensors:
            raise RuntimeError(f"{self.agent_name}: register() before metadata()")
        return TransportMetadata(self.agent_name, self.regions, self._agent_blob()).to_bytes()

    def is_connected(self, peer_name: str) -> bool:
        return peer_name in self.peers

    def connect(self, peer_name: str, peer_metadata: bytes) -> None:
        """Make ``peer_name`` readable. A repeat with the same metadata is a no-op."""
        meta = TransportMetadata.from_bytes(peer_metadata)
        if meta.agent_name != peer_name:
            raise TransferError(f"metadata is for agent {meta.agent_name!r}, not {peer_name!r}")
        known = self.peers.get(peer_name)
        if known == meta:
            return
        if known is not None:
            self.disconnect(peer_name)
        self._connect(meta)
        self.peers[peer_name] = meta

    def disconnect(self, peer_name: str) -> None:
        """Forget a peer; reading from it afterwards raises TransferError."""
        if self.peers.pop(peer_name, None) is not None:
            self._disconnect(peer_name)

    def read(self, peer_name: str, runs: list[PageRun], timeout_s: float = 30.0) -> ReadStats:
        """Copy each run's peer pages into our pages; block until done; return what moved."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        num_bytes = self._validate(peer_name, runs)
        start = time.perf_counter()
        if runs:
            self._read(self.peers[peer_name], runs, timeout_s)
        stats = ReadStats(num_descriptors=len(runs), num_pages=sum(r.num_pages for r in runs),
                          num_bytes=num_bytes, seconds=time.perf_counter() - start, num_reads=1)
        with self._stats_lock:
            self.last_read = stats
            self.total = self.total + stats
        return stats

    def send_notif(self, peer_name: str, message: bytes) -> None:
        """Send a small control message to a connected peer; in order per peer, never KV data."""
        if peer_name not in self.peers:
            raise TransferError(f"{self.agent_name}: cannot notify unknown peer {peer_name!r} (not connected)")
        self._send_notif(peer_name, message)

    @abstractmethod
    def get_notifs(self) -> list[tuple[str, bytes]]:
        """Messages that arrived since the last call, as (sender agent name, message)."""

    def close(self) -> None:
        for peer_name in list(self.peers):
            self.disconnect(peer_name)
        self._close()
        self.tensors, self.regions = {}, {}

    def _validate(self, peer_name: str, runs: list[PageRun]) -> int:
        peer = self.peers.get(peer_name)
        if peer is None:
            raise TransferError(f"{self.agent_name}: unknown peer {peer_name!r} (not connected)")
        written: list[tuple[str, int, int]] = []
        for run in runs:
            src, dst = peer.regions.get(run.group), self.regions.get(run.group)
            if src is None or dst is None:
                side = "peer" if src is None else "local"
                raise TransferError(f"group {run.group!r} is not registered on the {side} side ({run})")
            if src.page_nbytes != dst.page_nbytes:
                raise TransferError(f"group {run.group!r}: page size {src.page_nbytes} (peer) != "
                                    f"{dst.page_nbytes} (local)")
            _check_range(run, run.src_page, src.num_pages, "source", peer_name)
            _check_range(run, run.dst_page, dst.num_pages, "destination", self.agent_name)
            written.append((run.group, run.dst_page, run.dst_page + run.num_pages))
        _check_disjoint(written)
        return sum(r.num_pages * self.regions[r.group].page_nbytes for r in runs)

    @abstractmethod
    def _register(self, tensors: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def _agent_blob(self) -> bytes: ...

    @abstractmethod
    def _connect(self, peer: TransportMetadata) -> None: ...

    @abstractmethod
    def _disconnect(self, peer_name: str) -> None: ...

    @abstractmethod
    def _read(self, peer: TransportMetadata, runs: list[PageRun], timeout_s: float) -> None: ...

    @abstractmethod
    def _send_notif(self, peer_name: str, message: bytes) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


def _check_range(run: PageRun, first: int, num_pages: int, side: str, owner: str) -> None:
    if first < 0 or first + run.num_pages > num_pages:
        raise TransferError(
            f"{side} pages [{first}, {first + run.num_pages}) of group {run.group!r} are out of range: "
            f"{owner} has {num_pages} pages ({run})")


def _check_disjoint(written: list[tuple[str, int, int]]) -> None:
    """Two runs writing one destination page means the caller's mapping is wrong."""
    written.sort()
    for (g1, _, end1), (g2, start2, _) in zip(written, written[1:]):
        if g1 == g2 and start2 < end1:
            raise TransferError(f"destination page {start2} of group {g1!r} is written by two runs")
