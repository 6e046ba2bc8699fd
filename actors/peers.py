"""Find and connect KV peers through Ray's internal KV (namespace ``windserve``).

Each worker publishes, under key ``kv-peer/<agent name>``, its transport
metadata and a compatibility descriptor (model, dtype, tokens_per_block, page
layout, groups and windows: a plain dict). A reader connects lazily on first
use and only to a peer whose descriptor equals its own, field by field.

A record outlives a killed process (only ``unpublish`` removes it), so a
record found does not mean a live peer; and a replacement may publish under
a name we know with new metadata. Hence ``ensure_current`` (reconnect when
the record changed since we connected) and ``forget`` (drop a dead peer's
connection; the next use looks it up again).
"""

from __future__ import annotations

import base64
import json

from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

from actors.transport.base import KVTransport

NAMESPACE = "windserve"


class PeerMismatchError(ValueError):
    """The peer's compatibility descriptor differs from ours."""


class PeerNotFoundError(LookupError):
    """No peer of that name has published itself."""


def _key(agent_name: str) -> str:
    return f"kv-peer/{agent_name}"


def _canonical(compat: dict) -> dict:
    """What the descriptor looks like after a trip through JSON (tuples become lists)."""
    return json.loads(json.dumps(compat, sort_keys=True))


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in d.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def compat_differences(ours: dict, theirs: dict) -> list[str]:
    """One line per differing (dotted) field: ``field: ours=... peer=...``."""
    mine, peer = _flatten(_canonical(ours)), _flatten(_canonical(theirs))
    return [f"{field}: ours={_show(mine, field)} peer={_show(peer, field)}"
            for field in sorted(mine.keys() | peer.keys())
            if field not in mine or field not in peer or mine[field] != peer[field]]


def _show(fields: dict, field: str) -> str:
    return repr(fields[field]) if field in fields else "<absent>"


def lookup(peer_name: str) -> dict:
    """The record ``peer_name`` published (``compat``, ``transport``); PeerNotFoundError if none."""
    raw = _internal_kv_get(_key(peer_name), namespace=NAMESPACE)
    if raw is None:
        raise PeerNotFoundError(f"no KV peer {peer_name!r} published in namespace {NAMESPACE!r}")
    return json.loads(raw)


class PeerDirectory:
    """Publishes our transport; connects our transport to peers on demand, once each."""

    def __init__(self, transport: KVTransport, compat: dict) -> None:
        self.transport = transport
        self.compat = _canonical(compat)
        self._connected: dict[str, str] = {}  # peer -> the transport metadata (base64) we connected with

    def publish(self) -> None:
        record = {
            "compat": self.compat,
            "transport": base64.b64encode(self.transport.metadata()).decode(),
        }
        _internal_kv_put(_key(self.transport.agent_name), json.dumps(record).encode(),
                         overwrite=True, namespace=NAMESPACE)

    def unpublish(self) -> None:
        """Remove our record: peers that have not connected yet can no longer find us."""
        _internal_kv_del(_key(self.transport.agent_name), namespace=NAMESPACE)

    def is_connected(self, peer_name: str) -> bool:
        return peer_name in self._connected

    def ensure_connected(self, peer_name: str) -> None:
        """Fetch, check and connect ``peer_name`` unless already done.

        Raises PeerNotFoundError if it never published, PeerMismatchError
        (naming every differing field) if its descriptor differs from ours.
        """
        if peer_name not in self._connected:
            self.connect(peer_name, lookup(peer_name))

    def ensure_current(self, peer_name: str, record: dict) -> None:
        """Be connected with ``record`` (just looked up): a peer that re-published different
        metadata under the same name (a replacement process) is reconnected, so nothing is
        sent or read over the connection to the process it replaced."""
        if self._connected.get(peer_name) != record["transport"]:
            self.connect(peer_name, record)

    def connect(self, peer_name: str, record: dict) -> None:
        """Check ``record``'s descriptor and connect to its metadata (replacing an older one)."""
        differences = compat_differences(self.compat, record["compat"])
        if differences:
            raise PeerMismatchError(f"KV peer {peer_name!r} is incompatible: " + "; ".join(differences))
        self._connected.pop(peer_name, None)  # the transport drops the old metadata before the new
        self.transport.connect(peer_name, base64.b64decode(record["transport"]))
        self._connected[peer_name] = record["transport"]

    def forget(self, peer_name: str) -> None:
        """Drop the cached connection; the next ensure_connected fetches again.

        Call it only while nothing reads from that peer: the transport releases what a read uses.
        """
        self._connected.pop(peer_name, None)
        self.transport.disconnect(peer_name)
