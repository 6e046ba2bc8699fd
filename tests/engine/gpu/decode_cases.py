"""Decode-attention cases with NaN in every page slot a token must not read, and the written-out
float64 softmax over exactly the keys each token reads (shared by the reference and Triton tests).

A case: requests r with ``(num_new, seq_len)``; request r's tokens are at positions
``seq_len - num_new .. seq_len - 1`` (a decode step: 1 new; a verify step: 1 + drafts), all on table
row r. Only ``layer`` of the live slots ``[first window start, seq_len)`` holds data::

    slot of position k   0 ..... lo ......... seq_len-1  ...  end of last page
    content              NaN     [--- data ---]         NaN          (other layers: NaN everywhere)
    ordinal k // B < lo // B: -1, or (stale_pages) a page of NaN

One more table row belongs to no token, its pages all NaN, and padded rows (position -1) are mixed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAN = float("nan")
LAYERS = 2


@dataclass
class DecodeCase:
    query: torch.Tensor  # [N, Hq, D]
    kv_cache: torch.Tensor  # [pages, layers, 2, B, Hkv, D]
    block_tables: torch.Tensor  # [R + 1, M] int32
    table_rows: torch.Tensor  # [N] int32
    positions: torch.Tensor  # [N] int64
    sinks: torch.Tensor  # [Hq]
    layer: int
    window: int | None


def make_case(lens, block_size, window, num_kv, group, head_dim, num_layers, layer, num_padded, stale_pages,
              seed, dtype=torch.float32) -> DecodeCase:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = [-(-s // block_size) for _, s in lens]
    width = max(num_blocks) + 1
    num_pages = sum(num_blocks) + width + 1
    free = torch.randperm(num_pages, generator=gen).tolist()
    cache = torch.full((num_pages, num_layers, 2, block_size, num_kv, head_dim), NAN)
    tables = []
    for (q, s), blocks in zip(lens, num_blocks):
        lo = 0 if window is None else max(0, s - q - window + 1)
        table = [free.pop() if b >= lo // block_size or stale_pages else -1 for b in range(blocks)]
        for k in range(lo, s):
            cache[table[k // block_size], layer, :, k % block_size] = torch.randn(2, num_kv, head_dim, generator=gen)
        tables.append(table + [-1] * (width - blocks))
    tables.append([free.pop() for _ in range(width)])  # nobody's row: its pages stay NaN
    rows = [(r, p) for r, (q, s) in enumerate(lens) for p in range(s - q, s)]
    for _ in range(num_padded):
        rows.insert(int(torch.randint(len(rows) + 1, (), generator=gen)), (len(lens), -1))
    query = torch.randn(len(rows), num_kv * group, head_dim, generator=gen)
    return DecodeCase(query.to(dtype), cache.to(dtype), torch.tensor(tables, dtype=torch.int32),
                      torch.tensor([r for r, _ in rows], dtype=torch.int32),
                      torch.tensor([p for _, p in rows], dtype=torch.int64),
                      torch.randn(num_kv * group, generator=gen), layer, window)


def expected_output(case: DecodeCase, scale: float, with_sinks: bool) -> torch.Tensor:
    """float64, token by token and head by head: softmax over keys max(0, p - W + 1) .. p (+ the sink)."""
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    block_size, group = case.kv_cache.shape[3], case.query.shape[1] // case.kv_cache.shape[4]
    for t, (row, pos) in enumerate(zip(case.table_rows.tolist(), case.positions.tolist())):
        if pos < 0:
            continue
        table = case.block_tables[row].tolist()
        reads = range(0 if case.window is None else max(0, pos - case.window + 1), pos + 1)
        slots = [case.kv_cache[table[k // block_size], case.layer, :, k % block_size].double() for k in reads]
        keys, values = torch.stack([s[0] for s in slots]), torch.stack([s[1] for s in slots])
        for h in range(case.query.shape[1]):
            logits = keys[:, h // group] @ case.query[t, h].double() * scale
            if with_sinks:
                logits = torch.cat([logits, case.sinks[h:h + 1].double()])
            out[t, h] = logits.softmax(0)[: len(reads)] @ values[:, h // group]
    return out


def write_case(num_tokens, block_size, num_pages, seed):
    """A random cache [pages, LAYERS, 2, B, 2, 4], and for each token a distinct slot or (40%) -1."""
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_pages, LAYERS, 2, block_size, 2, 4, generator=gen)
    slots = torch.randperm(num_pages * block_size, generator=gen)[:num_tokens]
    skipped = torch.rand(num_tokens, generator=gen) < 0.4
    slot_mapping = torch.where(skipped, -1, slots)
    key, value = (torch.randn(num_tokens, 2, 4, generator=gen) for _ in range(2))
    return cache, slot_mapping, key, value


def expected_after_write(cache, layer, slot_mapping, key, value):
    """The cache with token t's K and V in slot_mapping[t]'s page and offset, one slot at a time."""
    expected = cache.clone()
    block_size = cache.shape[3]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected[slot // block_size, layer, 0, slot % block_size] = key[t]
            expected[slot // block_size, layer, 1, slot % block_size] = value[t]
    return expected
