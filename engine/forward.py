"""The one message a model's forward takes: new tokens of several requests plus their KV pages.

Request ``r`` brings ``query_lens[r]`` new tokens at the positions
``[seq_lens[r] - query_lens[r], seq_lens[r])``, concatenated over requests in
``input_ids`` / ``positions``::

    input_ids   | r0: prefill chunk | r1: decode | r2: verify 1 + D |
    query_lens  |        5          |     1      |        4         |
    seq_lens    |       13          |    40      |       22         |   (last position + 1)

The model writes the new tokens' K/V first (position ``p`` -> page
``block_tables[group][r][p // B]``, slot ``p % B``) and then attends over
the cached keys, so prefill chunks, decode steps and verify steps are one path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """Inputs of one forward pass. ``block_tables[group][r]`` is request r's ordinal list (-1 = unbound)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: dict[str, list[list[int]]]
    kv_caches: dict[str, torch.Tensor]
    tokens_per_block: int
    logits_indices: torch.Tensor | None = None

    def __post_init__(self) -> None:
        num_tokens = self.input_ids.shape[0]
        if self.input_ids.dim() != 1 or self.positions.shape != self.input_ids.shape:
            raise ValueError("input_ids and positions must both be 1-D of the same length")
        if not self.query_lens:
            raise ValueError("a ForwardBatch needs at least one request")
        if len(self.query_lens) != len(self.seq_lens):
            raise ValueError(f"{len(self.query_lens)} query_lens but {len(self.seq_lens)} seq_lens")
        if sum(self.query_lens) != num_tokens:
            raise ValueError(f"query_lens sum to {sum(self.query_lens)}, batch has {num_tokens} tokens")
        for q, s in zip(self.query_lens, self.seq_lens):
            if not 1 <= q <= s:
                raise ValueError(f"need 1 <= query_len <= seq_len, got query_len={q}, seq_len={s}")
        for name, tables in self.block_tables.items():
            if len(tables) != self.num_requests:
                raise ValueError(f"group {name!r} has {len(tables)} block tables for {self.num_requests} requests")
        # Attention derives query positions from the lengths; a device tensor is not checked (no sync).
        if self.positions.device.type == "cpu" and not torch.equal(self.positions, self.expected_positions()):
            raise ValueError("positions must run seq_len - query_len .. seq_len - 1 for each request")

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def expected_positions(self) -> torch.Tensor:
        """The positions the layout above implies; ``positions`` must equal this."""
        return positions_of(self.query_lens, self.seq_lens)


def positions_of(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """``cat([arange(s - q, s) for q, s in ...])``, built as one Python list (a decode step's few
    positions: ~2 us, where five whole-batch numpy ops cost ~10, more in a step whose weight reads
    have just emptied the caches; a 2,048-token prefill's: ~60 us, against its ~100 ms)::

        query_lens [2, 1, 3], seq_lens [5, 9, 3] -> [3, 4 | 8 | 0, 1, 2]
    """
    positions: list[int] = []
    for q, s in zip(query_lens, seq_lens):
        positions.extend(range(s - q, s))
    return torch.from_numpy(np.array(positions, dtype=np.int64))
