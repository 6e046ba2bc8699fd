"""One sampler call per step for the requests that sample one token (no drafts to verify).

Draws depend on (seed, output index) only: ``seed_for_output`` reseeds a
request's generator before each draw, so the same seeded request gives the
same tokens whichever worker samples which token, and after a preemption.

A grammar row (``Request.grammar``) is masked after its processors (engine.grammar), its matcher synced
to its outputs first; the static path masks its own rows on the device (engine.gpu.static_runner).

A request resumed with outputs given (``Request.given_outputs``: the
generation side's fallback, a local prefill of a prompt whose first k outputs
the context side already sampled and sent) still draws at each of those steps,
so its draws happen as they did there, then keeps the given token and logprob
in place of the drawn ones::

    output index    0 .. k-1                          k        k+1 ...
    context side    draw -> t0 .. t(k-1) (sent)
    this worker     draw, keep t0 .. t(k-1)           draw     draw     (same seeds: same tokens)
"""

from __future__ import annotations

import torch

from engine.grammar import masks_for
from engine.outputs import TokenLogprob
from engine.penalties import any_processors, history_of
from engine.request import Request
from engine.runner import RunOutput
from engine.sampler import Sampler, SampleResult
from engine.scheduler import ScheduledRequest


def seed_for_output(request: Request, ahead: int = 0) -> None:
    """Seed the request's generator for the output token it draws next (``ahead`` more: a
    verify step's row ``ahead``, whose token would be output ``num_output_tokens + ahead``)."""
    if request.generator is not None:
        request.generator.manual_seed(hash((request.seed, request.num_output_tokens + ahead)) & (2**63 - 1))


def sample_step(sampler: Sampler, scheduled: list[ScheduledRequest], output: RunOutput) -> SampleResult:
    """A step's samples: the device's (a static step), the host's (a plan step), or both (a mixed step:
    ``output.on_device[i]`` says whose; the host samples the rest, as ``sample_batch``)."""
    if output.samples is None:
        return sample_batch(sampler, scheduled, output)
    if output.on_device is None:
        return output.samples.sampled
    host = sample_batch(sampler, scheduled,
                        output._replace(spans=[None if d else s for d, s in zip(output.on_device, output.spans)]))
    device = output.samples.sampled
    pairs = [(device if d else host) for d in output.on_device]
    return SampleResult([p.token_ids[i] for i, p in enumerate(pairs)], [p.logprobs[i] for i, p in enumerate(pairs)])


def sample_batch(sampler: Sampler, scheduled: list[ScheduledRequest], output: RunOutput) -> SampleResult:
    """Row i belongs to ``scheduled[i]``; rows of requests that do not sample one token are placeholders."""
    picked = [i for i, span in enumerate(output.spans) if span is not None and not scheduled[i].draft_token_ids]
    token_ids: list[int] = [-1] * len(scheduled)
    logprobs: list[TokenLogprob | None] = [None] * len(scheduled)
    if not picked:
        return SampleResult(token_ids, logprobs)
    requests = [scheduled[i].request for i in picked]
    for request in requests:
        seed_for_output(request)
    rows = [output.spans[i][0] for i in picked]
    logits = output.logits
    if rows != list(range(logits.shape[0])):  # not simply every row in order (a decode step's): pick them
        logits = logits.index_select(0, torch.tensor(rows, device=logits.device))
    params = [r.params for r in requests]
    histories = [history_of(r) for r in requests] if any_processors(params) else None
    masks = masks_for([r.grammar for r in requests], [r.output_token_ids for r in requests], logits.shape[-1])
    result = sampler.sample(logits, params, [r.generator for r in requests],
                            [(r.seed, r.num_output_tokens) for r in requests], histories, masks)
    for j, (i, request) in enumerate(zip(picked, requests)):
        token_ids[i], logprobs[i] = request.given_or_sampled(result.token_ids[j], result.logprobs[j])
    return SampleResult(token_ids, logprobs)
