"""ModelRunner: turns a scheduled step into one forward pass and per-request logits.

The one seam that picks how a step runs::

    decode / verify step, static runner present  -> engine.gpu.static_runner: fixed buffers, a CUDA
                                                    graph replay (or eager on the CPU when forced),
                                                    sampled on the device (RunOutput.samples)
    mixed step (decodes beside prefill chunks)    -> two forwards: the decode rows as above, the
                                                    chunks as below; the host samples the chunks' rows
    anything else (prefill, or no static)         -> ForwardBatch + attention plan: engine.native's
                                                    kernels on the CPU, torch ops elsewhere

A mixed step splits rather than capturing graphs piecewise (attention eager between captured pieces,
vLLM's way): under steady arrivals most steps carry a prefill chunk, and the decode rows are the ones a
graph speeds up (a chunk's rows are few large matmuls, already device-bound). The split costs one more
pass over the weights per mixed step; piecewise graphs would also need the plan path's varlen attention
inside fixed buffers. ``num_static_decode_rows`` over ``num_decode_rows`` says how many decode rows took
the static path.

``static_runner_for`` decides at start whether a static runner exists: on CUDA by default
(``EngineConfig.use_static_buffers``), with graphs unless ``enforce_eager``; never graphs on the CPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.config import EngineConfig
from engine.forward import ForwardBatch, positions_of
from engine.gpu.paged_attention import attention_path, check_attention_path
from engine.gpu.static_runner import LaunchedStep, StaticStepRunner, StepSamples
from engine.gpu.step_buffers import StepShape
from engine.native import paged_decode_kernel, set_pool_yields_kernel
from engine.sampler import SampleResult
from engine.scheduler import ScheduledRequest
from kvcache import KVCacheManager, get_kv_capacity_tokens


class RunOutput(NamedTuple):
    """``logits[spans[i][0]:spans[i][1]]`` are scheduled request i's rows (``[1 + num_drafts, V]``);
    ``spans[i]`` is None for a prefill chunk short of the prompt's end (nothing to sample). A mixed step's
    logits are its decode rows' (static path) then its chunks' (plan path)::

        scheduled  [chunk a, decode b, decode c, chunk d (reaches the prompt's end)]
        logits     [b, c | d's last row]         on_device [False, True, True, False]
    """

    logits: torch.Tensor
    spans: list[tuple[int, int] | None]
    samples: StepSamples | None = None  # a static step's device samples (then the host samples nothing)
    on_device: list[bool] | None = None  # a mixed step: which requests' samples are in ``samples``


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
        self.num_decode_rows = self.num_static_decode_rows = 0  # decode / verify requests, those on the static path
        self.num_split_steps = 0  # mixed steps whose decode rows took the static path
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
        on_static = self._static_rows(scheduled)
        self.num_decode_rows += sum(item.is_decode and item.reaches_end for item in scheduled)
        self.num_static_decode_rows += len(on_static)
        if on_static and len(on_static) == len(scheduled):
            return RunOutput(*self.static.run(scheduled))
        if on_static:
            return self._run_split(scheduled, on_static)
        batch, spans = self._build(scheduled)
        return RunOutput(self.model(batch).float(), spans)

    def capture_reserved_bytes(self) -> int:
        """Device memory the CUDA graphs' capture reserved (torch.cuda.memory_reserved after less before);
        0 without graphs (the CPU, enforce_eager, no static path)."""
        graphs = self.static.graphs if self.static is not None else None
        return int(graphs.stats.get("reserved_bytes", 0)) if graphs is not None else 0

    def _static_rows(self, scheduled: list[ScheduledRequest]) -> list[int]:
        """The requests the static path runs: every one, or a mixed step's decodes, or none. A grammar
        request's rows go too: the static step masks them on the device (engine.gpu.static_runner)."""
        if self.static is None:
            return []
        if self.static.can_run(scheduled):
            return list(range(len(scheduled)))
        decodes = [i for i, item in enumerate(scheduled) if item.is_decode and item.reaches_end]
        return decodes if decodes and self.static.can_run([scheduled[i] for i in decodes]) else []

    def _run_split(self, scheduled: list[ScheduledRequest], on_static: list[int]) -> RunOutput:
        """A mixed step as two forwards: the decodes on the static path (sampled on the device), the rest
        on the plan path (sampled by the host); logits and spans as ``RunOutput`` draws them."""
        self.num_split_steps += 1
        static_at = {i: j for j, i in enumerate(on_static)}  # request index -> its row in the static run
        static_logits, static_spans, samples = self.static.run([scheduled[i] for i in on_static])
        batch, plan_spans = self._build([item for i, item in enumerate(scheduled) if i not in static_at])
        logits = torch.cat([static_logits, self.model(batch).float()])  # a copy: a graph's logits are reused
        shift, plan = len(static_logits), iter(plan_spans)
        spans = [static_spans[static_at[i]] if i in static_at else _shifted(next(plan), shift)
                 for i in range(len(scheduled))]

        def pick(values: list, empty) -> list:
            return [values[static_at[i]] if i in static_at else empty for i in range(len(scheduled))]
        sampled = SampleResult(pick(samples.sampled.token_ids, -1), pick(samples.sampled.logprobs, None))
        return RunOutput(logits, spans, StepSamples(sampled, pick(samples.verified, None)),
                         [i in static_at for i in range(len(scheduled))])

    @torch.inference_mode()
    def launch(self, scheduled: list[ScheduledRequest], after: LaunchedStep | None = None) -> LaunchedStep:
        """A static step queued on the device, collected later (engine.overlap); ``after``: the step
        launched before it and not collected, whose samples are this one's input tokens."""
        self.num_forward_passes += 1
        self.num_decode_rows += len(scheduled)
        self.num_static_decode_rows += len(scheduled)
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


def _shifted(span: tuple[int, int] | None, shift: int) -> tuple[int, int] | None:
    return None if span is None else (span[0] + shift, span[1] + shift)


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
    if device.type == "cuda":
        check_cuda_index(device, torch.cuda.device_count())
    attention = attention_path(device)
    check_attention_path(attention, device.type, config.allow_reference_attention)
    return StaticStepRunner(model, manager, shape, max_model_len + draft_len, device, use_graphs, attention)


def check_cuda_index(device: torch.device, num_devices: int) -> None:
    """ValueError naming the devices when ``cuda:N`` is not one of them (the static runner then enters
    ``torch.cuda.device(N)`` around capture and every launch: Triton launches on the current device)."""
    if device.index is not None and not 0 <= device.index < num_devices:
        raise ValueError(f"device {device} does not exist: this process sees {num_devices} CUDA device(s) "
                         f"(cuda:0..cuda:{num_devices - 1}; CUDA_VISIBLE_DEVICES renumbers them)")
