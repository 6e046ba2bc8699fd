"""Leases on a context worker's prefilled pages.

    prefill done ──► LEASED ──claim──► CLAIMED ──release──► (freed)
                       │  ▲ extend        │
                       │  └───────────────┘ (a claim holds until its own deadline)
                       └── deadline passes / abort / error ──► (freed)

A claim is granted only to a live lease, and a claimed lease cannot expire
under a transfer in flight; once freed, a request id is never granted again,
so a late claim is denied and the generation side moves nothing.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Callable


class LeaseState(enum.Enum):
    LEASED = "leased"
    CLAIMED = "claimed"


@dataclass
class Lease:
    state: LeaseState
    deadline: float


class LeaseDenied(RuntimeError):
    """The pages a generation side asked for are gone (expired, released, unknown)."""


class LeaseTable:
    """Lease state per request; ``clock`` is injectable for tests."""

    def __init__(self, lease_s: float = 30.0, claim_s: float = 60.0, clock: Callable[[], float] = time.time) -> None:
        if lease_s <= 0 or claim_s <= 0:
            raise ValueError("lease_s and claim_s must be > 0")
        self.lease_s = lease_s
        self.claim_s = claim_s
        self.clock = clock
        self._leases: dict[str, Lease] = {}
        self._ended: dict[str, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    @property
    def num_claimed(self) -> int:
        """Leases under a transfer now."""
        return sum(lease.state is LeaseState.CLAIMED for lease in self._leases.values())

    def grant(self, request_id: str) -> float:
        """Start a lease; returns its deadline."""
        if request_id in self._leases or request_id in self._ended:
            raise ValueError(f"request {request_id!r} already had a lease")
        deadline = self.clock() + self.lease_s
        self._leases[request_id] = Lease(LeaseState.LEASED, deadline)
        return deadline

    def claim(self, request_id: str) -> None:
        """Hold the pages for a transfer; raises LeaseDenied if they are gone."""
        lease = self._live(request_id)
        if lease.state is LeaseState.CLAIMED:
            raise LeaseDenied(f"request {request_id!r} is already claimed by a transfer")
        lease.state = LeaseState.CLAIMED
        lease.deadline = self.clock() + self.claim_s

    def extend(self, request_id: str, seconds: float) -> None:
        lease = self._live(request_id)
        lease.deadline = max(lease.deadline, self.clock() + seconds)

    def end(self, request_id: str, why: str) -> bool:
        """Forget the lease (the caller frees the pages); False if there was none."""
        if self._leases.pop(request_id, None) is None:
            return False
        self._ended[request_id] = why
        if len(self._ended) > 10_000:
            self._ended.pop(next(iter(self._ended)))
        return True

    def expired(self) -> list[str]:
        now = self.clock()
        return [rid for rid, lease in self._leases.items() if lease.deadline <= now]

    def _live(self, request_id: str) -> Lease:
        lease = self._leases.get(request_id)
        if lease is not None and lease.deadline > self.clock():
            return lease
        if lease is not None:
            raise LeaseDenied(f"the lease on request {request_id!r} expired; its pages are being freed")
        why = self._ended.get(request_id)
        if why is not None:
            raise LeaseDenied(f"request {request_id!r} no longer holds pages on the context worker ({why})")
        raise LeaseDenied(f"the context worker holds no pages for request {request_id!r}")
