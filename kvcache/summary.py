"""A bounded summary of the blocks a replica caches, for a router: a Bloom filter.

A router scores replicas by the prefix-cache hit a prompt would get on each
(kvcache.prefix). It cannot ask every replica per request, so each replica
reports, every stats period, what it caches. An exact set of 16-byte names
grows with the pool (1.6 MB per group at 100k cached blocks); a Bloom filter
sized for the pool's page count costs ``~9.6`` bits a page at a 1% false-positive
rate (120 KB at 100k pages) whatever the pages hold, and answers ``name in
summary`` with no false negatives.

A false positive only misleads routing: the router credits a block the replica
does not hold, and the replica itself decides the real hit from its own cache.
With ``n`` names in ``m`` bits and ``k`` probes the false-positive rate is
``(1 - exp(-k n / m)) ** k``; ``for_capacity`` picks ``m`` and ``k`` for a
target rate at ``n = capacity`` (the pool's page count bounds ``n``).

Block names are already uniform (blake2b digests, kvcache.hashing), so the
probes come from the name's own bytes (double hashing, Kirsch-Mitzenmacher):
``bit_i = (a + i * b) mod m`` with ``a``, ``b`` its two 64-bit halves. No
rehashing, and a replica and a router agree on the bits by construction.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

_HEADER = struct.Struct("<IB")  # number of bits, number of probes


class BlockSummary:
    """A Bloom filter over block names; ``to_bytes`` / ``from_bytes`` are its wire form."""

    def __init__(self, num_bits: int, num_probes: int, bits: bytes | None = None) -> None:
        if num_bits < 8 or not 1 <= num_probes <= 32:
            raise ValueError(f"need num_bits >= 8 and 1 <= num_probes <= 32, got {num_bits}, {num_probes}")
        self.num_bits = num_bits
        self.num_probes = num_probes
        size = (num_bits + 7) // 8
        if bits is not None and len(bits) != size:
            raise ValueError(f"{num_bits} bits need {size} bytes, got {len(bits)}")
        self._bits = bytearray(bits) if bits is not None else bytearray(size)

    @classmethod
    def for_capacity(cls, capacity: int, fp_rate: float = 0.01) -> BlockSummary:
        """Sized for ``capacity`` names at false-positive rate ``fp_rate``."""
        if capacity < 1 or not 0 < fp_rate < 1:
            raise ValueError(f"need capacity >= 1 and 0 < fp_rate < 1, got {capacity}, {fp_rate}")
        num_bits = max(8, math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2))
        num_probes = max(1, min(32, round(num_bits / capacity * math.log(2))))
        return cls(num_bits, num_probes)

    @classmethod
    def of(cls, names: Iterable[bytes], capacity: int, fp_rate: float = 0.01) -> BlockSummary:
        summary = cls.for_capacity(capacity, fp_rate)
        for name in names:
            summary.add(name)
        return summary

    def _probes(self, name: bytes) -> Iterable[int]:
        if len(name) < 16:
            raise ValueError(f"a block name has at least 16 bytes, got {len(name)}")
        a, b = struct.unpack_from("<QQ", name)
        b |= 1  # odd: the probes cycle through every bit position
        return ((a + i * b) % self.num_bits for i in range(self.num_probes))

    def add(self, name: bytes) -> None:
        for bit in self._probes(name):
            self._bits[bit >> 3] |= 1 << (bit & 7)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, bytes):
            return False
        return all(self._bits[bit >> 3] >> (bit & 7) & 1 for bit in self._probes(name))

    def false_positive_rate(self, num_names: int) -> float:
        """The expected rate with ``num_names`` names added."""
        return (1 - math.exp(-self.num_probes * num_names / self.num_bits)) ** self.num_probes

    def to_bytes(self) -> bytes:
        return _HEADER.pack(self.num_bits, self.num_probes) + bytes(self._bits)

    @classmethod
    def from_bytes(cls, data: bytes) -> BlockSummary:
        num_bits, num_probes = _HEADER.unpack_from(data)
        return cls(num_bits, num_probes, data[_HEADER.size:])
