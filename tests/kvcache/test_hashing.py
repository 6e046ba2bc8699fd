"""Block names: a fixed encoding (pinned values), the chain property, and ``extra``."""

import hashlib
import os
import struct
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    NO_PARENT,
    KVCacheSpec,
    LayerGroup,
    block_hash,
    block_hashes,
    extend_block_hashes,
    kv_fingerprint,
)
from tests.kvcache.helpers import make_spec

SETS_PREFIX_CACHING = True  # no manager here: run once

# Pinned: a change of encoding changes every name a peer or a router computes.
EXPECTED = ["28adf41aa2999c6f80e339654c872302", "ad9b8922e8fa4c7ec10dbf29ff61abbc"]


def test_names_are_pinned():
    assert [h.hex() for h in block_hashes(list(range(10)), 4)] == EXPECTED
    assert block_hash(NO_PARENT, [1, 2, 3], b"x").hex() == "2b4cc17e145a4f7012a1f4672e15d6b3"


def test_encoding_written_out():
    """The documented byte layout: len(parent) | parent | n | int64 LE ids | extra, blake2b-128."""
    def reference(parent, ids, extra):
        data = bytes([len(parent)]) + parent + struct.pack("<Q", len(ids)) + b"".join(
            i.to_bytes(8, "little", signed=True) for i in ids) + extra
        return hashlib.blake2b(data, digest_size=16).digest()

    first = reference(b"", [0, 1, 2, 3], b"")
    assert block_hashes(list(range(10)), 4) == [first, reference(first, [4, 5, 6, 7], b"")]
    assert block_hash(first, [2**40, 7], b"fp") == reference(first, [2**40, 7], b"fp")


def test_same_in_another_process():
    code = ("from kvcache import block_hashes, kv_fingerprint; from tests.kvcache.helpers import make_spec; "
            "print(block_hashes([5, 6, 7, 8], 2, kv_fingerprint(make_spec(16, 8), 'm'))[1].hex())")
    env = {**os.environ, "PYTHONHASHSEED": "123", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == block_hashes([5, 6, 7, 8], 2, kv_fingerprint(make_spec(16, 8), "m"))[1].hex()


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=40), B=st.integers(1, 8))
def test_chain_property(tokens, B):
    names = block_hashes(tokens, B)
    assert len(names) == len(tokens) // B  # a partial tail has no name
    for i, name in enumerate(names):
        parent = names[i - 1] if i else NO_PARENT
        assert name == block_hash(parent, tokens[i * B:(i + 1) * B])
    # Incremental (decode) form: any split into steps gives the same names.
    grown: list[bytes] = []
    for stop in range(0, len(tokens) + 1, 3):
        extend_block_hashes(grown, tokens[:stop], B)
    assert extend_block_hashes(grown, tokens, B) == names


def test_a_changed_token_renames_its_block_and_every_later_one():
    tokens = list(range(16))
    changed = tokens[:5] + [99] + tokens[6:]
    a, b = block_hashes(tokens, 4), block_hashes(changed, 4)
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:]))
    # Same tokens of block 1 under another parent: another name (the name carries the position).
    assert block_hash(a[0], tokens[4:8]) != block_hash(NO_PARENT, tokens[4:8])


def test_extra_changes_the_name():
    tokens = list(range(8))
    assert block_hashes(tokens, 4, b"a") != block_hashes(tokens, 4, b"b")
    assert block_hashes(tokens, 4, b"a")[1] != block_hashes(tokens, 4)[1]


def test_fingerprint_covers_model_and_geometry():
    spec = make_spec(16, 8)
    base = kv_fingerprint(spec, "model-a")
    assert base == kv_fingerprint(make_spec(16, 8), "model-a")
    others = [
        kv_fingerprint(spec, "model-b"),
        kv_fingerprint(make_spec(32, 8), "model-a"),
        kv_fingerprint(make_spec(16, 4), "model-a"),
        kv_fingerprint(KVCacheSpec(spec.groups, 8, 1, 2, torch.bfloat16), "model-a"),
        kv_fingerprint(KVCacheSpec((LayerGroup("full", (1, 3)),), 8, 1, 2), "model-a"),
    ]
    assert base not in others and len(set(others)) == len(others)


def test_bad_inputs():
    with pytest.raises(ValueError):
        block_hash(b"short", [1])
    with pytest.raises(ValueError):
        extend_block_hashes([b"x" * 16] * 3, [1, 2, 3, 4], 2)
