"""KV page transports: ``make_transport("nixl" | "local", name, **kw)``.

``nixl`` moves pages between processes over NIXL/UCX; ``local`` copies
between transports of one process (pass ``fabric=LocalFabric()``) for unit
tests of the layers above. Both honour the ``KVTransport`` contract.
"""

from __future__ import annotations

import importlib

from actors.transport.base import (
    KVTransport,
    PageRun,
    PeerUnreachable,
    ReadStats,
    TransferError,
    coalesce,
    unique_agent_name,
)
from actors.transport.local import LocalFabric, LocalTransport

# kind -> "module:class", imported on first use so "local" never loads NIXL.
_TRANSPORTS = {
    "local": "actors.transport.local:LocalTransport",
    "nixl": "actors.transport.nixl:NixlTransport",
}


def make_transport(kind: str, name: str, **kw) -> KVTransport:
    """Build a transport for agent ``name`` (unique per process; see ``unique_agent_name``)."""
    target = _TRANSPORTS.get(kind)
    if target is None:
        raise ValueError(f"unknown transport kind {kind!r}; choose one of {sorted(_TRANSPORTS)}")
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)(name, **kw)


__all__ = [
    "KVTransport", "LocalFabric", "LocalTransport", "PageRun", "PeerUnreachable", "ReadStats", "TransferError",
    "coalesce", "make_transport", "unique_agent_name",
]
