"""Overlapped decode steps (vLLM's async scheduling, SGLang's overlap scheduler): the host launches
step n+1 before it reads step n's samples, so the GPU runs one step while the host prepares the next.

    step() k:    launch n+1 (its tokens: n's samples, still on the device) ─┐   GPU: ... n ... n+1 ...
                 collect n: wait for n's samples, postprocess (stops, text) │
    step() k+1:  launch n+2 ───────────────────────────────────────────────┘   collect n+1 ...

What the host must know before launching step n+1 it knows without n's samples: each request computes
one more token, at the next position, with the next output index (the seeded draws' counter), into a
page bound now (``try_append``). Its input token is n's sample, read on the device
(``StaticStepBuffers.input_ids``). What it cannot know is whether n's sample stops the request (EOS, a
stop id or string): such a request's row in n+1 is computed and dropped, and its pages are freed only
once n+1 is collected, because n+1 writes its slot. That is the one rule: **no page returns to the pool
while a launched, uncollected step may read or write it** (``InFlight.frees``). A window page that
``release_stale`` unbinds at n's collect is one n+1 does not read (its query sits at the position the
release is computed from), so only whole-request frees wait.

A step is overlapped when every request in it is a plain decode (one token, no drafts, not replaying
given outputs, not prefill-only, no logits processors: engine.penalties reads its tokens on the host,
no grammar: its matcher must accept the previous step's token before the next mask exists) on
the static path; the next one is launched ahead only while the
running requests are exactly the in-flight step's (nothing waiting, nothing added or aborted since), and
only for those that do not end by length at n. Anything else collects the in-flight step and returns to
the ordinary schedule-run-postprocess step (the pipeline drains for one step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.gpu.static_runner import LaunchedStep, StaticStepRunner
from engine.scheduler import ScheduledRequest, Scheduler
from kvcache import KVCacheManager


@dataclass
class InFlight:
    """A launched step not yet collected, and the requests whose pages wait for it to be collected."""

    launched: LaunchedStep
    request_ids: set[str]
    frees: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, launched: LaunchedStep) -> InFlight:
        return cls(launched, {item.request.request_id for item in launched.scheduled})

    def release(self, manager: KVCacheManager) -> None:
        """Free the pages held back for this step, once it is collected (or dropped after a failure)."""
        for request_id in self.frees:
            manager.free(request_id)


def uses_async_scheduling(config: EngineConfig, static: StaticStepRunner | None, draft_len: int) -> bool:
    """``config.async_scheduling`` resolved: None is on where CUDA graphs run decode steps without
    drafts; True needs the static path and no speculative decoding (engine.overlap)."""
    if config.async_scheduling is None:
        return static is not None and static.graphs is not None and draft_len == 0
    if config.async_scheduling and static is None:
        raise ValueError("async_scheduling needs the static decode path (use_static_buffers; on CUDA by default)")
    if config.async_scheduling and draft_len > 0:
        raise ValueError("async_scheduling does not run with speculative decoding (max_draft_len > 0)")
    return config.async_scheduling


def may_overlap(scheduled: list[ScheduledRequest], scheduler: Scheduler) -> bool:
    """Every request is a plain decode: the next step's inputs follow from this one's on the device
    (and nothing of it reads its tokens on the host: no logits processors)."""
    return scheduler.propose is None and all(
        item.is_decode and item.reaches_end and not item.draft_token_ids
        and not item.request.prefill_only and not item.request.is_replaying
        and not item.request.params.has_processors  # its penalties read the token still on the device
        and item.request.grammar is None  # its mask needs the previous token, still on the device
        for item in scheduled)


def schedule_ahead(previous: list[ScheduledRequest], scheduler: Scheduler,
                   max_model_len: int) -> list[ScheduledRequest]:
    """The step after ``previous`` (launched, uncollected), each request one token on; [] when the running
    set changed, something waits, or a page cannot be bound without preempting (the ordinary step decides)."""
    running = scheduler.running
    if scheduler.waiting or len(running) != len(previous) or any(
            a is not b.request for a, b in zip(running, previous)):
        return []
    ahead, manager = [], scheduler.manager
    for item in previous:
        request = item.request
        if request.num_output_tokens + 1 >= request.params.max_tokens or request.num_tokens + 1 >= max_model_len:
            continue  # its sample in `previous` ends it by length
        if not manager.try_append(request.request_id, request.num_tokens + 1 - manager.num_tokens(request.request_id)):
            return []
        ahead.append(ScheduledRequest(request, 1))
    return ahead
