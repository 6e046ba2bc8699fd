"""ModelRunner: turns a scheduled step into one forward pass and per-request logits.

The one seam that picks how a step runs::

    decode / verify step, static runner present  -> engine.gpu.static_runner: fixed buffers, a CUDA
                                                    graph replay (or eager on the CPU when forced),
                                                    sampled on the device (RunOutput.samples)
    anything else (prefill, mixed, or no static)  -> ForwardBatch + attention plan: engine.native's
                                                    kernels on the CPU, torch ops elsewhere

``static_runner_for`` decides at start whether a static runner exists: on CUDA by default
(``EngineConfig.use_static_buffers``), with graphs unless ``enforce_eager``; never graphs on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.forward import ForwardBatch, positions_of
from engine.gpu.static_runner import LaunchedStep, StaticStepRunner, StepSamples
from engine.gpu.step_buffers import StepShape
from engine.native import paged_decode_kernel, set_pool_yields_kernel
from engine.scheduler import ScheduledRequest
from kvcache import KVCacheManager, get_kv_capacity_tokens


class RunOutput(NamedTuple):
    """``logits[spans[i][0]:spans[i][1]]`` are scheduled request i's rows (``[1 + num_drafts, V]``);
    ``spans[i]`` is None for a prefill chunk short of the prompt's end (nothing to sample)."""

    logits: torch.Tensor
    spans: list[tuple[int, int] | None]
    samples: StepSamples | None = None  # a static step's device samples (then the host samples nothing)


class ModelRunner:
    """Owns the model's device side: builds the ForwardBatch from block tables and runs it.

    The page tensors are the manager's own storage, so what the model writes
    is what a transport moves.
    """

    def __init__(self, model: torch.nn.Module, manager: KVCacheManager, device: str,
                 static: StaticStepRunner | None = None) -> None:
        self.model = model
        self.manager = manager
        self.device = torch.device(device)
        self.static = static
        self.num_forward_passes = 0
        if self.device.type == "cpu":
            paged_decode_kernel()  # built (or loaded from torch's cache) now, not inside the first step
        # how the native pool's helpers wait between kernels, set per step (engine/native/work_pool.cpp)
        self._set_pool_yields = set_pool_yields_kernel() if self.device.type == "cpu" else None

    @torch.inference_mode()
    def run(self, scheduled: list[ScheduledRequest]) -> RunOutput:
        """One forward pass; the logits of every request that samples this step, in one tensor."""
        self.num_forward_passes += 1
        if self._set_pool_yields is not None:  # decode-only: its helper yields the core between kernels
            self._set_pool_yields(all(item.is_decode for item in scheduled))
        if self.static is not None and self.static.can_run(scheduled):
            return RunOutput(*self.static.run(scheduled))
        batch, spans = self._build(scheduled)
        return RunOutput(self.model(batch).float(), spans)

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], after: LaunchedStep | None = None) -> LaunchedStep:
        """A static step queued on the device, collected later (engine.overlap); ``after``: the step
        launched before it and not collected, whose samples are this one's input tokens."""
        self.num_forward_passes += 1
        return self.static.launch(scheduled, after)

    def collect(self, step: LaunchedStep) -> RunOutput:
        """A launched step's output, once its samples are on the host."""
        return RunOutput(*self.static.collect(step))

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


def static_runner_for(config: EngineConfig, model: torch.nn.Module, manager: KVCacheManager, device: str, *,
                      max_model_len: int, draft_len: int, num_extra_kv_tokens: int) -> StaticStepRunner | None:
    """The static runner this engine's decode steps use, or None (the plan-based path for every step).

    Buffers hold ``max_num_seqs`` requests of ``1 + draft_len`` tokens, and a block table as wide as
    the largest request's capacity (``get_kv_capacity_tokens(max_model_len, ...)`` over B)."""
    device = torch.device(device)
    use = config.use_static_buffers if config.use_static_buffers is not None else device.type == "cuda"
    if not use or not hasattr(model, "forward_static"):
        return None
    block = manager.spec.tokens_per_block
    capacity = get_kv_capacity_tokens(max_model_len, draft_len, num_extra_kv_tokens)
    shape = StepShape(max_num_seqs=config.max_num_seqs, max_tokens=config.max_num_seqs * (1 + draft_len),
                      table_width=-(-capacity // block), tokens_per_block=block,
                      windows={group.name: group.window for group in manager.spec.groups})
    use_graphs = device.type == "cuda" and not config.enforce_eager
    return StaticStepRunner(model, manager, shape, max_model_len + draft_len, device, use_graphs)
