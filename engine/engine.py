"""LLMEngine: the step-wise engine both workers drive.

    add_request, prefill ──► Scheduler.add          reserve_prefilled + add_prefilled ──┐
                                  │                                                     │
    step():  Scheduler.schedule ─► ModelRunner.run ─► sample / verify ─► _advance ◄─────┘
                    │                                                     │ StopChecker, then
                    │                          finish: free │ park: keep │ run on: release_stale
                    └───────────── KVCacheManager (pages, windows) ◄──────┘

As nano-vllm's ``step``: schedule, run, postprocess; ``_advance`` is the one
place a request ends, and ``abort`` the one way in from outside. Drafting and
verifying are ``engine.speculation``'s; a request's updates come from its
``StopChecker`` (``take_update``).

Disaggregation has two entry points. The context side's ``prefill`` runs a
prompt to its handoff (``engine.handoff``: its first output with visible text,
at most ``HANDOFF_MAX_TOKENS``) and parks it (``Scheduler.park``): its pages stay
bound, and its one update carries a ``PrefillResult`` (the k outputs, block
ordinals); ``abort`` frees them once the KV has been sent or the lease lapsed.
The generation side's ``reserve_prefilled`` + ``add_prefilled`` start a
request whose KV (``num_kv_tokens``) a transport has written into its pages;
``resume`` starts one whose KV must be recomputed here (``engine.receiving``).
"""

from __future__ import annotations

import itertools
import random
import time

import torch

from engine.batch_sampling import sample_step
from engine.config import EngineConfig, max_model_len
from engine.grammar_compile import GrammarCompiler
from engine.handoff import is_handoff_due, prefill_result
from engine.host_memory import keep_freed_memory
from engine.layout import kv_cache_spec
from engine.outputs import FinishReason, RequestUpdate, TokenLogprob
from engine.overlap import InFlight, may_overlap, schedule_ahead, uses_async_scheduling
from engine.params import SamplingParams
from engine.receiving import ReceivingEntries
from engine.reports import engine_stats, routing_stats
from engine.request import Request
from engine.runner import ModelRunner, RunOutput, static_runner_for
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from engine.speculation import Speculation
from engine.stopping import StopChecker
from engine.tokenizer import IncrementalDecoder
from engine.worker_model import WorkerModel
from kvcache import KVCacheManager, extend_block_hashes, kv_fingerprint


class PromptTooLongError(ValueError):
    """The prompt (plus room for one output token) does not fit ``max_model_len`` or the cache."""


class LLMEngine(ReceivingEntries):
    def __init__(self, config: EngineConfig, *, role: str = "both", model: WorkerModel | None = None) -> None:
        if role not in ("both", "context", "generation"):
            raise ValueError(f"role must be 'both', 'context' or 'generation', got {role!r}")
        self.config = config
        self.role = role
        self.model = model or WorkerModel.load(config)
        if torch.device(self.model.device).type == "cpu":
            keep_freed_memory()  # activations reused from the heap, not faulted in again every step
        self.tokenizer = self.model.tokenizer
        spec = kv_cache_spec(self.model.hf_config, config.tokens_per_block, self.model.dtype)
        self.manager = KVCacheManager(spec, config.num_pages, device=self.model.device,
                                      enable_prefix_caching=config.enable_prefix_caching, eviction=config.eviction)
        self.hash_extra = kv_fingerprint(spec, config.model)
        vocab_size = getattr(self.model.hf_config, "vocab_size", None) or self.tokenizer.vocab_size  # logits' width
        self.grammars = GrammarCompiler(self.tokenizer.hf_tokenizer, vocab_size)
        self.sampler = Sampler()
        self.speculation = Speculation(config, is_drafting=role != "context", sampler=self.sampler)
        self.draft_len = self.speculation.draft_len
        self.num_extra_kv_tokens = self.speculation.num_extra_kv_tokens
        self.max_model_len = max_model_len(config, self.model.max_position_embeddings, draft_len=self.draft_len,
                                           num_extra_kv_tokens=self.num_extra_kv_tokens)
        propose = self.speculation.propose if self.speculation.drafter else None
        self.scheduler = Scheduler(self._scheduler_config(), self.manager, propose, self.speculation.policy)
        static = static_runner_for(config, self.model.module, self.manager, self.model.device,
                                   max_model_len=self.max_model_len, draft_len=self.draft_len,
                                   num_extra_kv_tokens=self.num_extra_kv_tokens)
        self.runner = ModelRunner(self.model.module, self.manager, self.model.device, static)
        self.sampler.counter_draws = static is not None  # mixed steps draw as the static steps do
        self.async_scheduling = uses_async_scheduling(config, static, self.draft_len)
        self._in_flight: InFlight | None = None  # engine.overlap: a launched step not yet collected
        self.num_steps_launched_ahead = 0  # steps launched before the host read the previous one's samples
        self._requests: dict[str, Request] = {}
        self._stoppers: dict[str, StopChecker] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.num_transfer_queried_tokens = 0  # generation side: prompt tokens it reserved for a transfer
        self.num_transfer_hit_tokens = 0  # ... whose KV it already held

    def _scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            draft_len=self.draft_len,
            num_extra_kv_tokens=self.num_extra_kv_tokens,
            include_drafts=self.role != "context",
        )

    @property
    def num_drafts_proposed(self) -> int:
        return self.speculation.num_drafts_proposed

    @property
    def num_drafts_accepted(self) -> int:
        return self.speculation.num_drafts_accepted

    # -- adding requests ---------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request to run until it finishes; ``step`` reports its updates."""
        self.scheduler.add(self._new_request(request_id, prompt_token_ids, params))

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a prefill-only request: parked at its handoff (``engine.handoff``) with its pages kept.

        Its one update carries ``prefill`` (a ``PrefillResult``) and all its
        outputs; ``abort`` frees its pages once they are no longer needed.
        """
        self.scheduler.add(self._new_request(request_id, prompt_token_ids, params, prefill_only=True))

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prefill_only: bool = False) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        self._check_new_id(request_id)
        self.check_prompt(len(prompt_token_ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        generator = None if params.is_greedy else torch.Generator(device="cpu")
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), generator,
                          prefill_only, seed, self.tokenizer.eos_token_ids)
        request.block_hashes = self._prompt_hashes(request.prompt_token_ids)
        if params.grammar is not None:  # compiled already by the engine loop (a cache hit), else here
            stop_ids = params.stop_token_ids + (() if params.ignore_eos else request.eos_token_ids)
            request.grammar = self.grammars.matcher(params.grammar, stop_ids)
        decoder = IncrementalDecoder(self.tokenizer, prompt_ids=prompt_token_ids)
        self._requests[request_id] = request
        self._stoppers[request_id] = StopChecker(request, decoder, self.tokenizer.eos_token_ids, self.max_model_len)
        return request

    def _check_new_id(self, request_id: str) -> None:
        """An id whose ended request's pages a launched step still holds cannot bind pages yet."""
        if self._in_flight is not None and request_id in self._in_flight.frees:
            raise ValueError(f"request {request_id!r} already exists (it ended; a running step still uses its pages)")

    def check_prompt(self, prompt_len: int) -> None:
        if prompt_len < 1:
            raise PromptTooLongError("the prompt is empty")
        if prompt_len >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, prompt plus at least one output token"
            )

    # -- running ---------------------------------------------------------
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestUpdate]:
        """Schedule, run the model, postprocess: one update per request that sampled.

        With ``async_scheduling`` a plain decode step is launched and collected one call later, after
        the next one has been launched (engine.overlap); each call still returns one step's updates."""
        start = time.perf_counter()
        try:
            if self._in_flight is not None:
                return self._step_overlapped()
            scheduled = self.scheduler.schedule()
            if not scheduled:
                return []
            if self.async_scheduling and self.runner.static.can_run(scheduled) and may_overlap(scheduled,
                                                                                                self.scheduler):
                self._in_flight = InFlight.of(self.runner.launch(scheduled))
                return self._step_overlapped()
        except BaseException:
            self._drop_in_flight()
            raise
        updates = self._postprocess(scheduled, self.runner.run(scheduled))
        if self.scheduler.draft_policy is not None:  # whole steps: drafting and verifying cost Python time too
            self.scheduler.draft_policy.record_step(scheduled, time.perf_counter() - start)
        return updates

    def _step_overlapped(self) -> list[RequestUpdate]:
        """Launch the step after the in-flight one (if it qualifies), then collect and postprocess the
        in-flight one; the pages of requests that ended meanwhile go back once nothing launched uses them."""
        previous = self._in_flight
        ahead = schedule_ahead(previous.launched.scheduled, self.scheduler, self.max_model_len)
        self._in_flight = InFlight.of(self.runner.launch(ahead, after=previous.launched)) if ahead else None
        self.num_steps_launched_ahead += bool(ahead)
        try:
            return self._postprocess(previous.launched.scheduled, self.runner.collect(previous.launched))
        finally:  # collected (or failed): nothing launched uses these pages any more
            previous.release(self.manager)

    def _drop_in_flight(self) -> None:
        """After a failed step: forget launched steps and free the pages they held back."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.release(self.manager)

    def _postprocess(self, scheduled: list[ScheduledRequest], output: RunOutput) -> list[RequestUpdate]:
        sampled = sample_step(self.sampler, scheduled, output)
        updates: list[RequestUpdate | None] = []
        for i, (item, span) in enumerate(zip(scheduled, output.spans)):
            request = item.request
            if request.is_finished:  # an overlapped step's row of a request that ended after its launch
                continue
            request.num_computed_tokens += item.num_new_tokens
            if span is None:  # a prefill chunk short of the prompt's end: nothing to sample yet
                self._cache_computed(request)
                self.manager.release_stale(request.request_id, request.num_computed_tokens)
            elif item.draft_token_ids:
                verified = output.samples.verified[i] if output.samples else None
                rows = output.logits[span[0]:span[1]]
                updates.append(self._advance(request, *self.speculation.verify(item, rows, verified)))
            else:
                updates.append(self._advance(request, [sampled.token_ids[i]], [sampled.logprobs[i]]))
        return [update for update in updates if update is not None]

    def _advance(self, request: Request, token_ids: list[int],
                 logprobs: list[TokenLogprob | None]) -> RequestUpdate | None:
        """Append sampled tokens, then finish, park or keep running the request.

        The one place a request ends from inside: finish frees its pages, park
        (prefill-only, at its handoff) keeps them, and a request that runs on
        releases the window pages no future query reads. A prefill-only
        request reports nothing before its handoff, nor a resumed one while it
        replays its given outputs: None (their next update carries them all).
        """
        stopper = self._stoppers[request.request_id]
        reason = stopper.add_tokens(token_ids, logprobs)
        # Tokens computed past a stop are dropped: computed never exceeds the kept tokens.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self._cache_computed(request)
        if request.prefill_only and is_handoff_due(request, stopper.hold_back, reason):
            self.scheduler.park(request)  # its one update: every output so far
            return stopper.take_update(None, prefill_result(request, self.manager, reason))
        is_quiet = request.prefill_only or (request.is_replaying and reason is None)  # one update for all k
        update = None if is_quiet else stopper.take_update(reason)
        if reason is not None:
            self._finish(request, reason)
        else:
            self.manager.release_stale(request.request_id, request.num_computed_tokens)
        return update

    def _cache_computed(self, request: Request) -> None:
        """Name the request's full blocks whose KV is written, for later requests (and its own preemption)."""
        if not self.manager.enable_prefix_caching:
            return
        B = self.config.tokens_per_block
        if len(request.block_hashes) < request.num_tokens // B:
            extend_block_hashes(request.block_hashes, request.all_token_ids, B, self.hash_extra)
        # Accepted drafts are computed before the manager holds them (the next schedule appends them).
        num_held = min(request.num_computed_tokens, self.manager.num_tokens(request.request_id))
        self.manager.cache_blocks(request.request_id, request.block_hashes, num_held)

    # -- ending ----------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its pages; False if it is unknown.

        Wherever: waiting, running, parked after its prefill, or only reserved
        (``reserve_prefilled``) for a transfer that has not been added yet.
        """
        request = self._requests.get(request_id)
        if request is not None:
            self._finish(request, FinishReason.ABORT)
            return True
        if self._in_flight is not None and request_id in self._in_flight.frees:
            return False  # it ended; its pages go back once the launched step that writes them is collected
        existed = self.manager.has_request(request_id)
        self.manager.free(request_id)
        return existed

    def _finish(self, request: Request, reason: FinishReason) -> None:
        held = self._in_flight is not None and request.request_id in self._in_flight.request_ids
        self.scheduler.finish(request, reason, free_pages=not held)
        if held:  # a launched step still writes its pages: freed when that step is collected
            self._in_flight.frees.append(request.request_id)
        self._requests.pop(request.request_id, None)
        self._stoppers.pop(request.request_id, None)

    def stats(self) -> dict:
        """Counters and gauges for metrics (engine.reports)."""
        return engine_stats(self)

    def routing_stats(self) -> dict:
        """What a KV-aware router weighs besides ``stats()``' page counts (engine.reports)."""
        return routing_stats(self)
