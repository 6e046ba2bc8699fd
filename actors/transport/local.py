"""In-process transport for tests of the layers above: same contract, plain copies.

Peers meet through a ``LocalFabric`` the test creates and hands to each
transport, so two tests (or two fabrics in one test) never see each other.
"""

from __future__ import annotations

from collections import deque

import torch

from actors.transport.base import KVTransport, PageRun, PeerUnreachable, TransferError, TransportMetadata


class LocalFabric:
    """Who is reachable in this process: agent name -> transport."""

    def __init__(self) -> None:
        self._members: dict[str, LocalTransport] = {}

    def join(self, transport: LocalTransport) -> None:
        if transport.agent_name in self._members:
            raise ValueError(f"agent name {transport.agent_name!r} is already on this fabric")
        self._members[transport.agent_name] = transport

    def leave(self, agent_name: str) -> None:
        self._members.pop(agent_name, None)

    def lookup(self, agent_name: str) -> LocalTransport:
        member = self._members.get(agent_name)
        if member is None:
            raise PeerUnreachable(f"no agent {agent_name!r} on this local fabric")
        return member


class LocalTransport(KVTransport):
    def __init__(self, agent_name: str, fabric: LocalFabric) -> None:
        super().__init__(agent_name)
        self.fabric = fabric
        self.inbox: deque[tuple[str, bytes]] = deque()
        fabric.join(self)

    def _register(self, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def _agent_blob(self) -> bytes:
        return b""

    def _connect(self, peer: TransportMetadata) -> None:
        if self.fabric.lookup(peer.agent_name).regions != peer.regions:
            raise TransferError(f"metadata of {peer.agent_name!r} does not match its registered tensors")

    def _disconnect(self, peer_name: str) -> None:
        pass

    def _read(self, peer: TransportMetadata, runs: list[PageRun], timeout_s: float) -> None:
        source = self.fabric.lookup(peer.agent_name)
        for run in runs:
            src = _as_bytes(source.tensors[run.group])
            dst = _as_bytes(self.tensors[run.group])
            dst[run.dst_page:run.dst_page + run.num_pages].copy_(src[run.src_page:run.src_page + run.num_pages])

    def _send_notif(self, peer_name: str, message: bytes) -> None:
        self.fabric.lookup(peer_name).inbox.append((self.agent_name, bytes(message)))

    def get_notifs(self) -> list[tuple[str, bytes]]:
        arrived = list(self.inbox)
        self.inbox.clear()
        return arrived

    def _close(self) -> None:
        self.fabric.leave(self.agent_name)


def _as_bytes(pages: torch.Tensor) -> torch.Tensor:
    """[num_pages, ...] -> [num_pages, page_nbytes] uint8 view, so any dtype copies byte for byte."""
    return pages.view(pages.shape[0], -1).view(torch.uint8)
