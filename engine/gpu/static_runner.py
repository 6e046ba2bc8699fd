"""A decode or verify step over fixed buffers: stage, run (a CUDA graph replay, or eagerly), sample on the device.

    launch:  scheduled ──► StepRequest per request ──► StaticStepBuffers.fill + upload (one host->device copy)
                       ──► CudaGraphs.replay(size) or forward_static eagerly ──► logits [live tokens, V]
                       ──► penalize (if asked), grammar masks (if asked), sample_tokens, accepted_drafts,
                           logprobs
                       ──► one queued device->host copy
    collect: wait for that copy ──► StepSamples

``run`` is launch then collect. engine.overlap launches step n+1 before collecting step n.

Steps qualify when every request brings one new token (plus drafts): prefill and mixed steps run
the plan-based path (engine.runner decides). The draws are engine.gpu.sampling's counter-based ones;
greedy tokens are the argmax as on the host path.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from engine.gpu.graph_runner import CudaGraphs
from engine.gpu.paged_attention import default_num_splits
from engine.gpu.sampling import SamplingRows, accepted_drafts, penalize, sample_tokens, top_logprobs
from engine.gpu.step_buffers import StaticStepBuffers, StepRequest, StepShape
from engine.grammar import TokenMasks, new_bitmask
from engine.models.decoder import StaticAttention
from engine.outputs import TokenLogprob
from engine.penalties import any_processors, penalty_rows, verify_histories
from engine.sampler import SampleResult, VerifyResult
from engine.scheduler import ScheduledRequest
from kvcache import KVCacheManager


class StepSamples(NamedTuple):
    """What the device sampled: ``sampled`` for requests without drafts (placeholders -1 / None
    elsewhere, as engine.batch_sampling returns them), ``verified[i]`` for request i's drafts."""

    sampled: SampleResult
    verified: list[VerifyResult | None]


class LaunchedStep(NamedTuple):
    """A static step whose device work is queued (``StaticStepRunner.launch``): its samples, packed, reach
    ``host`` once ``copied`` fires (None: already there, on the CPU). ``collect`` reads them. ``logits``
    are a graph's shared output: valid until the next launch (an overlapped step's are overwritten by the
    step launched after it, so only the samples, taken at launch, survive; verify steps never overlap)."""

    scheduled: list[ScheduledRequest]
    logits: torch.Tensor
    spans: list[tuple[int, int]]
    host: torch.Tensor
    copied: torch.cuda.Event | None
    num_top: int | None


class StaticStepRunner:
    """Owns the buffers, the RoPE table and (on CUDA, unless eager) the captured graphs."""

    def __init__(self, model: torch.nn.Module, manager: KVCacheManager, shape: StepShape, max_positions: int,
                 device: torch.device, use_graphs: bool, attention: str = "reference") -> None:
        self.model = model
        self.manager = manager
        self.buffers = StaticStepBuffers(shape, device)
        self.rope_table = model.rope_table(max_positions, device)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        kv_heads = {group: tensor.shape[4] for group, tensor in manager.storage.tensors.items()}
        self.num_splits = split_plan(self.buffers.sizes, shape.windows, kv_heads, max_positions, num_sms)
        self.attention = attention  # what paged_decode_attention runs here: "triton" or "reference"
        self.device_context = device_context(device)
        self.graphs = CudaGraphs(self._forward, self.buffers.sizes, device, attention) if use_graphs else None
        self.num_steps = 0
        if self.graphs is not None:
            with torch.inference_mode():
                self.graphs.capture()

    def can_run(self, scheduled: list[ScheduledRequest]) -> bool:
        """Decode or verify steps only: one new token per request, each one sampling, within the buffers."""
        shape = self.buffers.shape
        return (0 < len(scheduled) <= shape.max_num_seqs
                and all(item.is_decode and item.reaches_end for item in scheduled)
                and sum(item.num_query_tokens for item in scheduled) <= shape.max_tokens)

    def run(self, scheduled: list[ScheduledRequest]) -> tuple[torch.Tensor, list[tuple[int, int]], StepSamples]:
        """Logits of the live tokens [T, V], each request's rows of them, and the device's samples."""
        return self.collect(self.launch(scheduled))

    def launch(self, scheduled: list[ScheduledRequest], after: LaunchedStep | None = None) -> LaunchedStep:
        """Stage, upload, replay (or run eagerly) and sample, then queue the samples' one copy to the host;
        on a GPU this returns while the device still works. ``after``: the step launched just before,
        whose samples the host has not read: each request here is one of its requests one token on, its
        input token the one ``after`` sampled for it (engine.overlap)."""
        with self.device_context:
            return self._launch(scheduled, after)

    def _launch(self, scheduled: list[ScheduledRequest], after: LaunchedStep | None) -> LaunchedStep:
        sources = {item.request.request_id: first for item, (first, _) in zip(after.scheduled, after.spans)} \
            if after is not None else None
        size = self.buffers.fill([self._step_request(item, sources) for item in scheduled])
        self.buffers.upload()
        if self.graphs is not None and self.graphs.has(size):
            logits = self.graphs.replay(size)
        else:
            logits = self._forward(size)
        logits = logits[: self.buffers.num_tokens]
        spans, first = [], 0
        for item in scheduled:
            spans.append((first, first + item.num_query_tokens))
            first += item.num_query_tokens
        self.num_steps += 1
        return self._sample(logits, scheduled, spans)

    def collect(self, step: LaunchedStep) -> tuple[torch.Tensor, list[tuple[int, int]], StepSamples]:
        """Wait for a launched step's samples on the host (the step's one sync) and unpack them."""
        if step.copied is not None:
            step.copied.synchronize()
        samples = _unpack(step.host.tolist(), step.scheduled, step.spans, step.num_top)
        return step.logits, step.spans, samples

    def _step_request(self, item: ScheduledRequest, sources: dict[str, int] | None) -> StepRequest:
        request, params = item.request, item.request.params
        start, first_output, sampled_from = request.num_computed_tokens, request.num_output_tokens, -1
        if sources is not None:  # one token past what the host knows: the pending token is still on the device
            start, first_output, sampled_from = start + 1, first_output + 1, sources[request.request_id]
            pending = 0
        elif start < request.num_prompt_tokens:
            pending = request.prompt_token_ids[start]
        else:
            pending = request.output_token_ids[start - request.num_prompt_tokens]
        tables = {group: self.manager.get_block_ordinals(request.request_id, group) for group in self.buffers.groups}
        return StepRequest(request.request_id, [pending, *item.draft_token_ids], start, tables,
                           0.0 if params.is_greedy else params.temperature, params.top_p, params.top_k,
                           request.seed, first_output, sampled_from)

    def _forward(self, size: int) -> torch.Tensor:
        return static_forward(self.model, self.buffers, size, self.rope_table, self.manager.storage.tensors,
                              self.num_splits.get(size))

    def _sample(self, logits: torch.Tensor, scheduled: list[ScheduledRequest],
                spans: list[tuple[int, int]]) -> LaunchedStep:
        """Draw every live token's sample and verify drafts on the device, then queue one copy to the host."""
        num_tokens, buffers = logits.shape[0], self.buffers
        params = [item.request.params for item in scheduled]
        rows = SamplingRows(buffers.float_view("temperature", num_tokens), buffers.token_view("top_k", num_tokens),
                            buffers.float_view("top_p", num_tokens), *buffers.seeds(num_tokens),
                            buffers.token_view("counters", num_tokens))
        scores = _masked(_processed(logits, scheduled), logits, scheduled)
        ids = sample_tokens(scores, rows, is_greedy=all(p.is_greedy for p in params),
                            is_filtered=any(not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0) for p in params))
        buffers.keep_samples(ids)
        parts = [ids]
        if any(item.draft_token_ids for item in scheduled):
            parts.append(accepted_drafts(ids, buffers.token_view("input_ids", num_tokens),
                                         buffers.token_view("token_offsets", num_tokens),
                                         buffers.token_view("table_rows", num_tokens), len(scheduled)))
        num_top = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if num_top is not None:
            chosen, values, top_ids = top_logprobs(logits, ids, num_top)
            parts += [chosen, values.flatten(), top_ids.flatten()]
        packed = torch.cat([part.double() for part in parts])
        if not packed.is_cuda:
            return LaunchedStep(scheduled, logits, spans, packed, None, num_top)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)  # the step's one device->host copy
        copied = torch.cuda.Event()
        copied.record()
        return LaunchedStep(scheduled, logits, spans, host, copied, num_top)


def _processed(logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    """The logits after each token row's processors (engine.penalties: a verify row's drafts before it
    count as outputs), or ``logits`` where no request has any. The host knows every row's tokens: a
    request with processors never rides an overlapped step (engine.overlap.may_overlap)."""
    if not any_processors([item.request.params for item in scheduled]):
        return logits
    params = [item.request.params for item in scheduled for _ in range(item.num_query_tokens)]
    histories = [h for item in scheduled for h in verify_histories(item.request, item.draft_token_ids)]
    return penalize(logits, penalty_rows(params, histories, logits.shape[-1], logits.device))


def _masked(scores: torch.Tensor, logits: torch.Tensor, scheduled: list[ScheduledRequest]) -> torch.Tensor:
    """``scores`` with each grammar request's disallowed tokens at -inf, outside the graph: a decode row's
    mask after its outputs, a verify request's row i after its outputs and drafts[:i] (engine.grammar, as
    the host path masks them; the drafts were cut at their first invalid token when proposed). The masks
    are filled on the host, where the matchers are (a grammar request never rides an overlapped step, so
    its outputs are all known), and applied on the device (xgrammar's kernel for the tensor's device).
    ``logits`` are never written: they are the graph's output and what logprobs report."""
    if all(item.request.grammar is None for item in scheduled):
        return scores
    vocab_size = scores.shape[-1]
    bitmask, rows, row = new_bitmask(scores.shape[0], vocab_size), [], 0
    for item in scheduled:
        matcher, request = item.request.grammar, item.request
        if matcher is not None:
            masks = matcher.verify_masks(request.output_token_ids, item.draft_token_ids, vocab_size)
            bitmask[row:row + len(masks.rows)] = masks.bitmask
            rows += [row + i for i in masks.rows]
        row += item.num_query_tokens
    scores = scores.clone() if scores is logits else scores
    return TokenMasks(bitmask, rows).apply(scores)


def device_context(device: torch.device):
    """``torch.cuda.device(N)`` for ``cuda:N`` (Triton launches, and eager kernels' streams, follow the
    current device, not the tensors'), a no-op context elsewhere. Entered per launch, not set for the
    process: engines on different devices may share one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def split_plan(sizes: list[int], windows: dict[str, int | None], kv_heads: dict[str, int], max_positions: int,
               num_sms: int | None) -> dict[int, dict[str, int]]:
    """Split-KV ranges per padded size and layer group, fixed when the graphs are captured: on a GPU
    (``num_sms`` multiprocessors) ``default_num_splits`` over the group's longest read (its window, or
    ``max_positions``); {} on the CPU (None: its torch reference has no splits). A token's keys are cut by
    its own context on the device, so one count serves every length (a short context's ranges are short)."""
    if num_sms is None:
        return {}
    return {size: {group: default_num_splits(size, kv_heads[group],
                                             max_positions if window is None else min(window, max_positions),
                                             num_sms)
                   for group, window in windows.items()}
            for size in sizes}


def static_forward(model: torch.nn.Module, buffers: StaticStepBuffers, size: int,
                   rope_table: tuple[torch.Tensor, torch.Tensor], kv_caches: dict[str, torch.Tensor],
                   num_splits: dict[str, int] | None = None) -> torch.Tensor:
    """The model over the buffers' first ``size`` tokens, logits [size, V]: what a graph captures.
    ``num_splits``: split-KV ranges per layer group (``split_plan``; absent: 1)."""
    static = StaticAttention(  # a padded token's row -1 -> 0: its position -1 already reads nothing
        positions=buffers.token_view("positions", size).long(),
        table_rows=buffers.token_view("table_rows", size).clamp(min=0),
        block_tables={group: buffers.views["tables", group] for group in buffers.groups},
        slots={group: buffers.views["slots", group][:size].long() for group in buffers.groups},
        num_splits=num_splits or {},
    )
    return model.forward_static(buffers.input_ids(size).long(), static, rope_table, kv_caches)


def _unpack(host: list[float], scheduled: list[ScheduledRequest], spans: list[tuple[int, int]],
            num_top: int | None) -> StepSamples:
    """Split the copied values (ids [T], accepted [R] if drafts, chosen [T], top values [T, k], top ids
    [T, k] if logprobs) into per-request results."""
    num_tokens = spans[-1][1]
    ids = [int(v) for v in host[:num_tokens]]
    has_drafts = any(item.draft_token_ids for item in scheduled)
    accepted = [int(v) for v in host[num_tokens:num_tokens + len(scheduled)]] if has_drafts else []
    logprob_of = _logprob_reader(host[num_tokens + len(accepted):], ids, num_tokens, num_top)
    token_ids: list[int] = [-1] * len(scheduled)
    logprobs: list[TokenLogprob | None] = [None] * len(scheduled)
    verified: list[VerifyResult | None] = [None] * len(scheduled)
    for i, (item, (first, _)) in enumerate(zip(scheduled, spans)):
        wanted = item.request.params.logprobs
        if item.draft_token_ids:
            rows = range(first, first + accepted[i] + 1)
            verified[i] = VerifyResult([ids[t] for t in rows], accepted[i], [logprob_of(t, wanted) for t in rows])
        else:
            token_ids[i], logprobs[i] = item.request.given_or_sampled(ids[first], logprob_of(first, wanted))
    return StepSamples(SampleResult(token_ids, logprobs), verified)


def _logprob_reader(values: list[float], ids: list[int], num_tokens: int, num_top: int | None):
    """``read(t, wanted)``: token t's TokenLogprob with its ``wanted`` best alternatives (None: not asked).
    ``values``: chosen [T], then top values [T, k], then top ids [T, k]."""
    width = (len(values) - num_tokens) // (2 * num_tokens) if num_top is not None else 0
    top_values, top_ids = num_tokens, num_tokens * (1 + width)

    def read(t: int, wanted: int | None) -> TokenLogprob | None:
        if wanted is None or num_top is None:
            return None
        first, last = t * width, t * width + wanted
        pairs = zip(values[top_ids + first:top_ids + last], values[top_values + first:top_values + last])
        return TokenLogprob(ids[t], values[t], tuple((int(i), v) for i, v in pairs))
    return read
