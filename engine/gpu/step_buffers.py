"""Fixed device buffers for every input of a decode or verify step, refilled in place each step.

A CUDA graph replays kernels over the addresses it was captured with, so a step's inputs must live
in tensors that never move. Tokens are laid out flat, request after request, padded to a bucket::

    token t         0     1  2  3     4   | 5 ...  n-1 (padding)  |  ... max_tokens-1
    request row     0  |  1  1  1  |  2   | -1                    |
    position        40 |  9 10 11  |  77  | -1 (reads nothing, writes nothing)
    token offset    0  |  0  1  2  |  0   | -1   (1 + drafts of row 1: offsets 0..2)

A request whose first token the previous step sampled on the device and the host has not read yet
(an overlapped step, engine.overlap) names that token's index in the previous step in ``sampled_from``;
the step reads it from ``last_sampled`` (what the previous step's sampling left on the device) in place
of ``input_ids``. Everywhere else ``sampled_from`` is -1.

Per layer group: ``block_tables[row, i]`` = the page of ordinal ``i`` (-1 unbound; rows past the live
requests all -1) and ``slots[t] = page * B + position % B`` (-1: write nothing). Every token field is a
view of one int32 tensor, staged on the host (pinned on a GPU) and moved with one copy; floats
(temperature, top_p) travel as their bit patterns, a seed as two 31-bit halves (its low 62 bits: the
host's counter draws reduce it alike, engine.gpu.sampling).

The block tables are sized for the worst case (``max_num_seqs`` rows of ``max_model_len / B`` ordinals:
64 x 8,192 at 131k positions), but a step touches only its live region: n rows, as wide as the longest
of their tables (w ordinals). Only that region is staged, checked and moved, packed row after row
behind the token fields (so still one host-to-device copy), then copied into place on the device; the
last step's region, where it reaches past this one's, is reset to -1 first, so no stale ordinal stays::

    device table [max_num_seqs, table_width]       host staging (one copy)
    ┌──── w ────┬───────────────────────┐           [token fields | slots | g0: n x w | g1: n x w]
    │ live      │ -1                    │ n
    ├───────────┘ (last step's region,  │
    │ -1            reset where it      │
    │               reaches past)       │
    └───────────────────────────────────┘
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

_TOKEN_FIELDS = ("input_ids", "sampled_from", "positions", "table_rows", "token_offsets", "top_k", "temperature",
                 "top_p", "seed_lo", "seed_hi", "counters")
_PADDING = {"sampled_from": -1, "positions": -1, "table_rows": -1, "token_offsets": -1,
            "top_p": np.float32(1.0).view(np.int32)}
_SEED_MASK = (1 << 31) - 1


def bucket_sizes(max_tokens: int) -> list[int]:
    """Padded batch sizes a graph is captured for: 1, 2, 4, 8, steps of 8 to 64, steps of 16 beyond,
    and ``max_tokens`` itself::

        max_tokens 40  -> [1, 2, 4, 8, 16, 24, 32, 40]
        max_tokens 100 -> [1, 2, 4, 8, 16, 24, ..., 64, 80, 96, 100]
    """
    sizes = [s for s in (1, 2, 4) if s < max_tokens]
    size = 8
    while size < max_tokens:
        sizes.append(size)
        size += 8 if size < 64 else 16
    return sizes + [max_tokens]


def choose_bucket(num_tokens: int, sizes: list[int]) -> int:
    """The smallest size that holds ``num_tokens``; ValueError past the largest."""
    index = bisect.bisect_left(sizes, num_tokens)
    if num_tokens < 1 or index == len(sizes):
        raise ValueError(f"a static step holds 1..{sizes[-1]} tokens, got {num_tokens}")
    return sizes[index]


class StepRequest(NamedTuple):
    """One request's part of a decode/verify step: its new tokens (last accepted + drafts) from
    ``first_position``; ``tables[group]`` its ordinals; ``first_output`` the output index the first
    token's sample will be (seeds draws by (seed, output index))."""

    name: str
    token_ids: list[int]
    first_position: int
    tables: dict[str, list[int]]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    first_output: int = 0
    sampled_from: int = -1  # >= 0: the first token is what the previous step sampled at this token index


@dataclass(frozen=True)
class StepShape:
    """The buffers' fixed sizes: ``max_tokens`` = max_num_seqs x (1 + max_draft_len)."""

    max_num_seqs: int
    max_tokens: int
    table_width: int
    tokens_per_block: int
    windows: dict[str, int | None]  # group name -> window (None = full)


class StaticStepBuffers:
    """The host staging tensor and its device twin, both carved into the named views above."""

    def __init__(self, shape: StepShape, device: torch.device | str) -> None:
        self.shape = shape
        self.device = torch.device(device)
        self.groups = list(shape.windows)
        self.sizes = bucket_sizes(shape.max_tokens)
        t, r, m, g = shape.max_tokens, shape.max_num_seqs, shape.table_width, len(self.groups)
        self.token_fields_end = t * len(_TOKEN_FIELDS) + g * t  # then the live table regions, packed
        pin = self.device.type == "cuda"
        self.host = torch.zeros(self.token_fields_end + g * r * m, dtype=torch.int32, pin_memory=pin)
        self.flat = torch.zeros(self.token_fields_end + g * r * m, dtype=torch.int32, device=self.device)
        self.host_views = _carve(self.host.numpy(), self.groups, t)
        self.views = _carve(self.flat, self.groups, t)
        tables = torch.full((g, r, m), -1, dtype=torch.int32, device=self.device)  # what the kernels read
        self.views.update({("tables", group): tables[k] for k, group in enumerate(self.groups)})
        self._staged: dict[str, tuple[int, int, int]] = {}  # group -> (offset in host, rows, width) staged
        self._regions = {group: (0, 0) for group in self.groups}  # group -> (rows, width) on the device
        self.last_sampled = torch.zeros(t, dtype=torch.int32, device=self.device)  # the last step's samples
        self.num_tokens = self.num_requests = 0
        self._copied: torch.cuda.Event | None = None  # the last upload's copy, on a GPU
        self.fill([])
        self.upload()

    def fill(self, requests: list[StepRequest]) -> int:
        """Stage a step's requests (every other row padding) and return its padded size (0: empty step).

        On a GPU it first waits for the last upload's copy to have read the staging tensor: a pinned copy
        runs after ``upload`` returns, and restaging under it would send this step's values as the last
        step's. (The step's one device-to-host read of its samples also waits for it; this does not lean
        on that.) Staged with whole-array numpy writes: the host's time per step is what a GPU waits for
        (bench.host_step)."""
        if self._copied is not None:
            self._copied.synchronize()
        views = self.host_views
        for name in _TOKEN_FIELDS:
            views[name].fill(_PADDING.get(name, 0))
        for group in self.groups:
            views["slots", group].fill(-1)
        if len(requests) > self.shape.max_num_seqs:
            raise ValueError(f"{len(requests)} requests, the buffers hold {self.shape.max_num_seqs}")
        self.num_requests, self.num_tokens = len(requests), 0
        self._staged = {group: (self.token_fields_end, 0, 0) for group in self.groups}
        views.update({("tables", group): np.empty((0, 0), dtype=np.int32) for group in self.groups})
        if requests:
            self.num_tokens = self._stage(requests)
        return choose_bucket(self.num_tokens, self.sizes) if self.num_tokens else 0

    def upload(self) -> None:
        """The one host-to-device copy of a step (asynchronous from pinned memory on a GPU): the token
        fields and the live table regions, which two small device copies per group then put in place
        (resetting the last step's region to -1 first where it reaches past this one's)."""
        end = max((offset + rows * width for offset, rows, width in self._staged.values()),
                  default=self.token_fields_end)
        self.flat[:end].copy_(self.host[:end], non_blocking=True)
        for group, (offset, rows, width) in self._staged.items():
            table, (old_rows, old_width) = self.views["tables", group], self._regions[group]
            if old_rows > rows or old_width > width:
                table[:old_rows, :old_width].fill_(-1)
            if rows and width:
                table[:rows, :width].copy_(self.flat[offset:offset + rows * width].view(rows, width))
            self._regions[group] = (rows, width)
        if self.flat.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _stage(self, requests: list[StepRequest]) -> int:
        """Every request's tokens, row after row from token 0; returns the number of tokens."""
        counts = np.fromiter((len(r.token_ids) for r in requests), np.int64, len(requests))
        num_tokens = int(counts.sum())
        if num_tokens > self.shape.max_tokens:
            raise ValueError(f"the step's {num_tokens} tokens pass the buffers' {self.shape.max_tokens}")
        rows = np.repeat(np.arange(len(requests)), counts)  # each token's request row
        firsts = np.cumsum(counts) - counts  # each row's first token
        offsets = np.arange(num_tokens) - firsts[rows]
        per_row = np.array([(r.first_position, r.first_output, r.top_k, r.seed & _SEED_MASK,
                             (r.seed >> 31) & _SEED_MASK, r.sampled_from) for r in requests], dtype=np.int64)
        floats = np.array([(r.temperature, r.top_p) for r in requests], dtype=np.float32).view(np.int32)
        positions = per_row[rows, 0] + offsets
        views, t = self.host_views, slice(0, num_tokens)
        views["input_ids"][t] = [token for r in requests for token in r.token_ids]
        views["sampled_from"][firsts] = per_row[:, 5]
        views["positions"][t] = positions
        views["table_rows"][t] = rows
        views["token_offsets"][t] = offsets
        views["counters"][t] = per_row[rows, 1] + offsets
        views["top_k"][t] = per_row[rows, 2]
        views["seed_lo"][t] = per_row[rows, 3]
        views["seed_hi"][t] = per_row[rows, 4]
        views["temperature"][t] = floats[rows, 0]
        views["top_p"][t] = floats[rows, 1]
        block = self.shape.tokens_per_block
        last = (per_row[:, 0] + counts - 1) // block  # each row's last ordinal (written)
        offset = self.token_fields_end
        for group, window in self.shape.windows.items():
            tables = self._stage_table(requests, group, offset)
            first_read = np.zeros_like(last) if window is None else np.maximum(0, per_row[:, 0] - window + 1) // block
            self._check_bound(requests, group, tables, first_read, last)
            pages = tables[rows, positions // block].astype(np.int64)
            views["slots", group][t] = pages * block + positions % block
            offset += tables.size
        return num_tokens

    def _stage_table(self, requests: list[StepRequest], group: str, offset: int) -> np.ndarray:
        """The group's live region, packed at ``offset`` of the host staging: [n rows, w = the longest
        table], -1 past each row's own table. Returns it (``host_views["tables", group]`` too)."""
        width = max(len(request.tables[group]) for request in requests)
        if width > self.shape.table_width:
            request = max(requests, key=lambda r: len(r.tables[group]))
            raise ValueError(f"request {request.name!r}: {width} ordinals in group {group!r}, "
                             f"the buffers hold {self.shape.table_width}")
        tables = self.host_views["tables", group] = self.host.numpy()[offset:offset + len(requests) * width].reshape(
            len(requests), width)
        tables.fill(-1)
        for row, request in enumerate(requests):
            table = request.tables[group]
            tables[row, : len(table)] = table
        self._staged[group] = (offset, len(requests), width)
        return tables

    def _check_bound(self, requests: list[StepRequest], group: str, tables: np.ndarray, first_read: np.ndarray,
                     last: np.ndarray) -> None:
        """Every ordinal a row's tokens read or write is bound, else ValueError naming the first missing one::

            positions a .. S-1, window W:  ordinals  max(0, a - W + 1) // B  ..  (S - 1) // B
        """
        width = tables.shape[1]
        columns = np.arange(width)
        needed = (columns >= first_read[:, None]) & (columns <= last[:, None])
        unbound = needed & (tables < 0)
        past = last >= width  # an ordinal past the table: never bound
        if not unbound.any() and not past.any():
            return
        row = int(np.flatnonzero(unbound.any(axis=1) | past)[0])
        missing = np.flatnonzero(unbound[row])
        ordinal = int(missing[0]) if missing.size else width
        block = self.shape.tokens_per_block
        raise ValueError(f"request {requests[row].name!r}, layer group {group!r}: ordinal {ordinal} "
                         f"(positions {ordinal * block}..{ordinal * block + block - 1}) is read but unbound")

    def input_ids(self, num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` input ids on the device, each ``sampled_from`` token taken from
        ``last_sampled`` (fixed shapes, no host sync: a graph captures it)."""
        source = self.views["sampled_from"][:num_tokens]
        sampled = self.last_sampled.index_select(0, source.clamp(min=0))
        return torch.where(source >= 0, sampled, self.views["input_ids"][:num_tokens])

    def keep_samples(self, ids: torch.Tensor) -> None:
        """Leave a step's sampled ids [T] on the device for the next step's ``sampled_from`` tokens."""
        self.last_sampled[: ids.shape[0]].copy_(ids)

    def token_view(self, name: str, num_tokens: int) -> torch.Tensor:
        """The device view of a per-token field, its first ``num_tokens`` rows."""
        return self.views[name][:num_tokens]

    def float_view(self, name: str, num_tokens: int) -> torch.Tensor:
        """temperature / top_p as float32 (their int32 bits reinterpreted; no copy)."""
        return self.views[name][:num_tokens].view(torch.float32)

    def seeds(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.views["seed_lo"][:num_tokens], self.views["seed_hi"][:num_tokens]


def _carve(flat, groups: list[str], t: int) -> dict:
    """Named views of ``flat`` (numpy array or tensor): token fields, then per group slots [t]."""
    views, offset = {}, 0
    for name in _TOKEN_FIELDS:
        views[name], offset = flat[offset:offset + t], offset + t
    for group in groups:
        views["slots", group], offset = flat[offset:offset + t], offset + t
    return views
