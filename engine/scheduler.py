"""Continuous batching with chunked prefill under a token budget.

Each step the scheduler picks, oldest first, the running requests' next
tokens (a decode token plus drafts, or the next prefill chunk), then admits
waiting requests while the token budget, ``max_num_seqs`` and free pages
allow. Pages are taken through the manager's check-then-do calls; when a
running request cannot grow, the newest running request is preempted (its
pages freed, recomputed later from its tokens), so an accepted request is
never dropped and the scheduler never catches a full cache.

A request leaves by ``finish`` (pages freed) or, prefill-only, by ``park``
(pages kept until the engine aborts it once its KV has been sent).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.draft_policy import DraftLengthPolicy
from engine.outputs import FinishReason
from engine.request import Request, Status
from kvcache import KVCacheManager

Proposer = Callable[[Request, int], list[int]]


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    draft_len: int = 0
    num_extra_kv_tokens: int = 0
    include_drafts: bool = True


@dataclass
class ScheduledRequest:
    """Run ``num_new_tokens`` of ``request`` from its ``num_computed_tokens``, then ``draft_token_ids``."""

    request: Request
    num_new_tokens: int
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def reaches_end(self) -> bool:
        """This step computes the request's last uncomputed token, so it samples."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def is_decode(self) -> bool:
        """One new token (and its drafts, if any): a decode or verify, not a prefill chunk."""
        return self.num_new_tokens == 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: KVCacheManager, propose: Proposer | None = None,
                 draft_policy: DraftLengthPolicy | None = None) -> None:
        self.config = config
        self.manager = manager
        self.propose = propose
        self.draft_policy = draft_policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_queried_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_prefix_hit_tokens = 0

    # -- admission ------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = Status.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """A request whose KV pages the manager already holds (a transferred prompt)."""
        request.status = Status.RUNNING
        self.running.append(request)
        self.running.sort(key=lambda r: r.arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _allocate_kwargs(self) -> dict:
        return dict(draft_len=self.config.draft_len, num_extra_kv_tokens=self.config.num_extra_kv_tokens,
                    include_drafts=self.config.include_drafts)

    # -- one step --------------------------------------------------------
    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        for request in list(self.running):
            if budget <= 0:
                break
            if request.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            item = self._schedule_running(request, budget)
            if item is not None:
                scheduled.append(item)
                budget -= item.num_query_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            item = self._admit(self.waiting[0], budget)
            if item is None:
                break
            scheduled.append(item)
            budget -= item.num_query_tokens
        return scheduled

    def _schedule_running(self, request: Request, budget: int) -> ScheduledRequest | None:
        rid = request.request_id
        grow = request.num_tokens - self.manager.num_tokens(rid)
        while not self.manager.try_append(rid, grow):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return None
        return self._chunk(request, budget)

    def _admit(self, request: Request, budget: int) -> ScheduledRequest | None:
        """Bind the request's pages, starting at its prefix-cache hit: only the rest is computed."""
        hit = self.manager.find_cached_prefix(request.block_hashes, request.num_tokens)
        kwargs = dict(self._allocate_kwargs(), num_computed_tokens=hit, block_hashes=request.block_hashes)
        if not self.manager.can_allocate(request.num_tokens, **kwargs):
            return None
        self.manager.allocate(request.request_id, request.num_tokens, **kwargs)
        self.waiting.popleft()
        request.status = Status.RUNNING
        request.num_computed_tokens = hit
        if request.num_output_tokens == 0:  # a recompute after preemption is not the prompt's hit
            request.num_cached_tokens = hit
        self.num_prefix_queried_tokens += request.num_tokens
        self.num_prefix_hit_tokens += hit
        self.running.append(request)
        return self._chunk(request, budget)

    def _chunk(self, request: Request, budget: int) -> ScheduledRequest:
        item = ScheduledRequest(request, min(request.num_uncomputed_tokens, budget))
        if item.reaches_end and self.propose is not None and request.may_draft:
            item.draft_token_ids = self.propose(request, self._max_drafts(request, budget - item.num_new_tokens))
        return item

    def _max_drafts(self, request: Request, budget: int) -> int:
        left_in_request = request.params.max_tokens - request.num_output_tokens - 1
        left_in_model = self.config.max_model_len - request.num_tokens - 1
        wanted = self.config.draft_len
        if self.draft_policy is not None:
            wanted = min(wanted, self.draft_policy.draft_len(request.num_drafts_accepted, request.num_drafts_proposed,
                                                             request.num_output_tokens))
        return max(0, min(wanted, budget, left_in_request, left_in_model))

    # -- endings ---------------------------------------------------------
    def preempt(self, request: Request) -> None:
        """Free the request's pages and queue it first, to recompute from its tokens."""
        self.manager.free(request.request_id)
        self.running.remove(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def park(self, request: Request) -> None:
        """Take a prefill-only request out of running with its pages kept, for a transfer.

        It leaves the scheduler's queues: nothing schedules it again, and only
        ``finish`` (the engine's ``abort``) frees its pages.
        """
        self.running.remove(request)
        request.status = Status.PARKED

    def finish(self, request: Request, reason: FinishReason, free_pages: bool = True) -> None:
        """End a request wherever it is (waiting, running or parked) and free its pages (unless
        ``free_pages`` is False: a launched step still uses them, and the engine frees them later)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.finish_reason = reason
        request.status = Status.FINISHED
        if free_pages:
            self.manager.free(request.request_id)
