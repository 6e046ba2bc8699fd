"""Token-tagged pages for prefix-cache tests.

Every slot of a page holds ``token_tag(position, token_id)``, written when a
request "computes" that position. A page reused from the cache must then
hold exactly the position and the token the reader expects: a page of
another position, or of the same position after a different token, or one
nobody wrote, reads back a different value. Expectations come from
positions alone (which keys the query at ``q`` reads: ``[q - W + 1, q]``),
never from the manager's own arithmetic.
"""

from __future__ import annotations

import torch

from kvcache import KVCacheManager, block_hashes, extend_block_hashes

VOCAB = 1000
UNWRITTEN = -7.0
JUNK = -3.0


def token_tag(position: int, token_id: int) -> float:
    return float(position * VOCAB + token_id + 1)


def write_tokens(manager: KVCacheManager, rid: str, token_ids, start: int, stop: int, junk: bool = False,
                 skip_unbound: bool = False) -> None:
    """Write the tags of positions ``[start, stop)`` (or JUNK) into the pages that hold them, in every group.

    ``skip_unbound``: a transfer delivers only bound ordinals (the windowed slice)."""
    if stop <= start:
        return
    B = manager.spec.tokens_per_block
    positions = torch.arange(start, stop)
    values = torch.full((stop - start,), JUNK) if junk else torch.tensor(
        [token_tag(p, token_ids[p]) for p in range(start, stop)])
    for group in manager.spec.groups:
        pages = torch.tensor(manager.get_block_ordinals(rid, group.name), dtype=torch.long)[positions // B]
        bound = pages >= 0 if skip_unbound else torch.ones_like(pages, dtype=torch.bool)
        missing = positions[bound & (pages < 0)].tolist()
        assert not missing, f"{rid}/{group.name}: no page for positions {missing}"
        pages, slots, row = pages[bound], positions[bound] % B, values[bound]
        manager.storage.tensors[group.name][pages, :, :, slots] = row[:, None, None, None, None]


def read_problems(manager: KVCacheManager, rid: str, token_ids, first_query: int, last_query: int) -> list[str]:
    """Keys that the queries ``first_query..last_query`` of ``rid`` read and do not find in place."""
    B = manager.spec.tokens_per_block
    problems = []
    for group in manager.spec.groups:
        lowest = 0 if group.window is None else max(0, first_query - group.window + 1)
        positions = torch.arange(lowest, last_query + 1)
        table = torch.tensor(manager.get_block_ordinals(rid, group.name), dtype=torch.long)
        pages = table[positions // B]
        if (pages < 0).any():
            problems.append(f"{rid}/{group.name}: keys {positions[pages < 0].tolist()} have no page")
            continue
        got = manager.storage.tensors[group.name][pages, :, :, positions % B].flatten(1)
        want = torch.tensor([token_tag(p, token_ids[p]) for p in positions.tolist()])
        wrong = (got != want[:, None]).any(dim=1)
        if wrong.any():
            p = int(positions[wrong][0])
            problems.append(f"{rid}/{group.name}: key {p} reads {got[p - lowest, 0].item()}, "
                            f"want {want[p - lowest].item()} (and {int(wrong.sum()) - 1} more)")
    return problems


def reference_hit(manager: KVCacheManager, hashes: list[bytes], P: int) -> int:
    """The hit from positions alone: the largest h = k*B <= P - 1 such that, in every group,
    each key below h that the query at h reads sits in a cached block."""
    B = manager.spec.tokens_per_block
    for k in range(min(len(hashes), (P - 1) // B), 0, -1):
        h = k * B
        ok = True
        for group in manager.spec.groups:
            lowest = 0 if group.window is None else max(0, h - group.window + 1)
            cached = manager.cached_block_hashes(group.name)
            ok = ok and all(hashes[p // B] in cached for p in range(lowest, h))
        if ok:
            return h
    return 0


def run_request(manager: KVCacheManager, rid: str, token_ids: list[int], P: int, *, draft_len: int = 0,
                num_extra: int = 0, hit_rule=None) -> tuple[int, list[str]]:
    """Admit ``token_ids[:P]`` with a prefix hit, compute the rest of the prompt, then decode the
    remaining ``token_ids`` one by one, writing junk into the draft scratch at each step as a
    verify pass does. Returns the hit and every misplaced key any query read. Leaves the request live."""
    B = manager.spec.tokens_per_block
    hashes = block_hashes(token_ids[:P], B)
    h = (hit_rule or KVCacheManager.find_cached_prefix)(manager, hashes, P)
    kwargs = {"num_computed_tokens": h, "draft_len": draft_len, "num_extra_kv_tokens": num_extra,
              "block_hashes": hashes}
    assert manager.can_allocate(P, **kwargs), f"{rid}: the test sized the pools too small"
    manager.allocate(rid, P, **kwargs)
    write_tokens(manager, rid, token_ids, h, P)
    problems = read_problems(manager, rid, token_ids, h, P - 1)
    manager.cache_blocks(rid, hashes, P)
    manager.release_stale(rid, P)
    for n in range(P, len(token_ids)):
        manager.append(rid, 1)
        write_tokens(manager, rid, token_ids, n + 1, n + 1 + draft_len, junk=True)
        write_tokens(manager, rid, token_ids, n, n + 1)
        problems += read_problems(manager, rid, token_ids, n, n)
        manager.cache_blocks(rid, extend_block_hashes(hashes, token_ids[:n + 1], B), n + 1)
        manager.release_stale(rid, n + 1)
        manager.check_integrity()
    manager.check_integrity()
    return h, problems


def fill_storage(manager: KVCacheManager) -> None:
    for tensor in manager.storage.tensors.values():
        tensor.fill_(UNWRITTEN)
