"""Names of full KV blocks: a chain hash over token ids, stable across machines.

Block ``i`` of a sequence (tokens ``[i*B, (i+1)*B)``) is named by::

    hash[i] = blake2b-128( len(parent) | parent | n | token ids as int64 LE | extra )
    parent  = hash[i-1], or b"" for block 0

    tokens:  [ t0 .. tB-1 ][ tB .. t2B-1 ][ t2B .. ]   (a partial tail has no name)
    hashes:     hash[0] ──────► hash[1]
                  (parent)        (parent of the next)

Because the parent is hashed in, ``hash[i]`` names the whole prefix
``[0, (i+1)*B)``, and its position with it: two requests whose block ``i``
hashes agree hold the same tokens at the same positions in every block up to
``i``. ``extra`` is whatever else changes the KV of those tokens; callers pass
``kv_fingerprint(spec, model_name)`` so two models, or two page geometries,
never share a name.

The encoding is fixed (byte order, widths, separators by length prefix), so a
name computed by a context worker, a generation worker and the router on
different machines agrees. Python's ``hash()`` is never used: it is salted
per process.

Collisions: a hit is trusted on the name alone, without comparing token ids.
blake2b is a cryptographic hash, so a collision cannot be constructed on
purpose, and by the birthday bound the chance that any two of ``n`` distinct
blocks share a 128-bit name is below ``n**2 / 2**129``: for ``n = 10**12``
blocks (far more than a cluster caches in its life) that is about ``1.5e-15``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence

from kvcache.spec import KVCacheSpec

DIGEST_SIZE = 16
NO_PARENT = b""


def block_hash(parent_hash: bytes, block_token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """The name of one full block, given its parent's name (``NO_PARENT`` for block 0)."""
    if len(parent_hash) not in (0, DIGEST_SIZE):
        raise ValueError(f"parent hash has {len(parent_hash)} bytes, expected 0 or {DIGEST_SIZE}")
    digest = hashlib.blake2b(digest_size=DIGEST_SIZE)
    digest.update(bytes([len(parent_hash)]) + parent_hash)
    digest.update(struct.pack(f"<Q{len(block_token_ids)}q", len(block_token_ids), *block_token_ids))
    digest.update(extra)
    return digest.digest()


def extend_block_hashes(
    hashes: list[bytes], token_ids: Sequence[int], tokens_per_block: int, extra: bytes = b""
) -> list[bytes]:
    """Append to ``hashes`` the names of the full blocks of ``token_ids`` it lacks; returns it.

    ``token_ids`` is the whole sequence so far and ``hashes`` the names of its
    first ``len(hashes)`` blocks, so a decode loop calls this after each step
    and hashes only the blocks that became full.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    num_full = len(token_ids) // tokens_per_block
    if len(hashes) > num_full:
        raise ValueError(f"{len(hashes)} hashes for {len(token_ids)} tokens ({num_full} full blocks)")
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else NO_PARENT
        hashes.append(block_hash(parent, token_ids[i * tokens_per_block:(i + 1) * tokens_per_block], extra))
    return hashes


def block_hashes(token_ids: Sequence[int], tokens_per_block: int, extra: bytes = b"") -> list[bytes]:
    """Names of the full blocks of ``token_ids``: ``len(token_ids) // B`` entries."""
    return extend_block_hashes([], token_ids, tokens_per_block, extra)


def kv_fingerprint(spec: KVCacheSpec, model_name: str) -> bytes:
    """``extra`` for ``block_hash``: the model and everything of the page geometry."""
    described = json.dumps({"model": model_name, "spec": spec.describe()}, sort_keys=True)
    return hashlib.blake2b(described.encode(), digest_size=DIGEST_SIZE).digest()
