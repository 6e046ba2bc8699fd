"""ModelRunner: turns a scheduled step into one forward pass and per-request logits."""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.forward import ForwardBatch, positions_of
from engine.native import paged_decode_kernel
from engine.scheduler import ScheduledRequest
from kvcache import KVCacheManager


class RunOutput(NamedTuple):
    """``logits[spans[i][0]:spans[i][1]]`` are scheduled request i's rows (``[1 + num_drafts, V]``);
    ``spans[i]`` is None for a prefill chunk short of the prompt's end (nothing to sample)."""

    logits: torch.Tensor
    spans: list[tuple[int, int] | None]


class ModelRunner:
    """Owns the model's device side: builds the ForwardBatch from block tables and runs it.

    The page tensors are the manager's own storage, so what the model writes
    is what a transport moves.
    """

    def __init__(self, model: torch.nn.Module, manager: KVCacheManager, device: str) -> None:
        self.model = model
        self.manager = manager
        self.device = torch.device(device)
        self.num_forward_passes = 0
        if self.device.type == "cpu":
            paged_decode_kernel()  # built (or loaded from torch's cache) now, not inside the first step

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> RunOutput:
        """One forward pass; the logits of every request that samples this step, in one tensor."""
        batch, spans = self._build(scheduled)
        logits = self.model(batch).float()
        self.num_forward_passes += 1
        return RunOutput(logits, spans)

    def _build(self, scheduled: list[ScheduledRequest]) -> tuple[ForwardBatch, list[tuple[int, int] | None]]:
        input_ids: list[int] = []
        query_lens, seq_lens, logits_indices = [], [], []
        rows: list[tuple[int, int] | None] = []
        for item in scheduled:
            request = item.request
            start = request.num_computed_tokens
            tokens = request.all_token_ids[start:start + item.num_new_tokens] + item.draft_token_ids
            input_ids.extend(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            if item.reaches_end:
                first = len(logits_indices)
                end_of_request = len(input_ids)
                logits_indices.extend(range(end_of_request - 1 - len(item.draft_token_ids), end_of_request))
                rows.append((first, len(logits_indices)))
            else:
                rows.append(None)
        positions = positions_of(query_lens, seq_lens)
        tables = {
            group.name: [self.manager.get_block_ordinals(item.request.request_id, group.name) for item in scheduled]
            for group in self.manager.spec.groups
        }
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=positions.to(self.device),
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=tables,
            kv_caches=self.manager.storage.tensors,
            tokens_per_block=self.manager.spec.tokens_per_block,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=self.device),
        )
        return batch, rows
