"""LLMEngine: the step-wise engine both workers drive.

    add_request, prefill ──► Scheduler.add          reserve_prefilled + add_prefilled ──┐
                                  │                                                     │
    step():  Scheduler.schedule ─► ModelRunner.run ─► sample / verify ─► _advance ◄─────┘
                    │                                                     │ StopChecker, then
                    │                          finish: free │ park: keep │ run on: release_stale
                    └───────────── KVCacheManager (pages, windows) ◄──────┘

As nano-vllm's ``step``: schedule, run, postprocess; ``_advance`` is the one
place a request ends, and ``abort`` the one way in from outside.

Disaggregation has two entry points. The context side's ``prefill`` runs a
prompt to its first token and parks it (``Scheduler.park``): its pages stay
bound, and its last update carries a ``PrefillResult`` (first token, block
ordinals); ``abort`` frees them once the KV has been sent or the lease lapsed.
The generation side's ``reserve_prefilled`` + ``add_prefilled`` start a
request whose prompt KV a transport has written into its pages.
"""

from __future__ import annotations

import itertools
import random
import time

import torch

from engine.batch_sampling import sample_batch, seed_for_output
from engine.config import EngineConfig, max_model_len
from engine.draft_policy import DraftLengthPolicy
from engine.drafter import make_drafter
from engine.layout import kv_cache_spec
from engine.outputs import FinishReason, PrefillResult, RequestUpdate, TokenLogprob
from engine.params import SamplingParams
from engine.reports import engine_stats, routing_stats
from engine.request import Request
from engine.runner import ModelRunner, RunOutput
from engine.sampler import Sampler
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from engine.stopping import StopChecker
from engine.tokenizer import IncrementalDecoder
from engine.worker_model import WorkerModel
from kvcache import KVCacheManager, extend_block_hashes, kv_fingerprint


class PromptTooLongError(ValueError):
    """The prompt (plus room for one output token) does not fit ``max_model_len`` or the cache."""


class LLMEngine:
    def __init__(self, config: EngineConfig, *, role: str = "both", model: WorkerModel | None = None) -> None:
        if role not in ("both", "context", "generation"):
            raise ValueError(f"role must be 'both', 'context' or 'generation', got {role!r}")
        self.config = config
        self.role = role
        self.model = model or WorkerModel.load(config)
        self.tokenizer = self.model.tokenizer
        spec = kv_cache_spec(self.model.hf_config, config.tokens_per_block, self.model.dtype)
        self.manager = KVCacheManager(spec, config.num_pages, device=self.model.device,
                                      enable_prefix_caching=config.enable_prefix_caching)
        self.hash_extra = kv_fingerprint(spec, config.model)
        is_drafting = config.max_draft_len > 0 and role != "context"
        drafter = make_drafter(config.drafter, config.max_draft_len) if is_drafting else None
        self.drafter = drafter
        self.max_model_len = max_model_len(config, self.model.max_position_embeddings, draft_len=self.draft_len,
                                           num_extra_kv_tokens=self.num_extra_kv_tokens)
        policy = DraftLengthPolicy(self.draft_len) if drafter else None
        self.scheduler = Scheduler(self._scheduler_config(), self.manager, self._propose if drafter else None, policy)
        self.runner = ModelRunner(self.model.module, self.manager, self.model.device)
        self.sampler = Sampler()
        self._requests: dict[str, Request] = {}
        self._stoppers: dict[str, StopChecker] = {}
        self._arrivals = itertools.count()
        self._seeds = random.Random(config.seed)
        self.num_drafts_proposed = 0
        self.num_drafts_accepted = 0
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
    def draft_len(self) -> int:
        return self.drafter.max_draft_len if self.drafter else 0

    @property
    def num_extra_kv_tokens(self) -> int:
        declared = self.drafter.num_extra_kv_tokens if self.drafter else 0
        return declared + self.config.num_extra_kv_tokens

    def _propose(self, request: Request, max_len: int) -> list[int]:
        return self.drafter.propose(request.all_token_ids, max_len) if max_len > 0 else []

    # -- adding requests ---------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    first_token: tuple[int, TokenLogprob | None] | None = None) -> None:
        """Queue a request to run until it finishes; ``step`` reports its updates.

        ``first_token`` (id, logprob): a context worker already sampled it; the prefill here keeps
        it in place of its own draw (``engine.batch_sampling``), as ``add_prefilled`` would.
        """
        request = self._new_request(request_id, prompt_token_ids, params)
        request.first_token = first_token
        self.scheduler.add(request)

    def prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a prefill-only request: parked after its first token with its pages kept.

        Its last update carries ``prefill`` (a ``PrefillResult``); ``abort``
        frees its pages once they are no longer needed.
        """
        self.scheduler.add(self._new_request(request_id, prompt_token_ids, params, prefill_only=True))

    def reserve_prefilled(self, request_id: str, prompt_token_ids: list[int]) -> bool:
        """Bind pages for a prompt whose KV will arrive by transfer; False if the cache is full now.

        Blocks this cache already holds are bound from it
        (``manager.get_cached_ordinals``): a transfer skips them.
        """
        prompt_len = len(prompt_token_ids)
        kwargs = dict(num_computed_tokens=prompt_len, draft_len=self.draft_len,
                      num_extra_kv_tokens=self.num_extra_kv_tokens, block_hashes=self._prompt_hashes(prompt_token_ids))
        if not self.manager.can_allocate(prompt_len, **kwargs):
            return False
        self.manager.allocate(request_id, prompt_len, **kwargs)
        self.num_transfer_queried_tokens += prompt_len
        self.num_transfer_hit_tokens += self._reused_tokens(request_id, prompt_len)
        return True

    def _prompt_hashes(self, token_ids: list[int]) -> list[bytes]:
        if not self.manager.enable_prefix_caching:
            return []
        return extend_block_hashes([], token_ids, self.config.tokens_per_block, self.hash_extra)

    def _reused_tokens(self, request_id: str, prompt_len: int) -> int:
        """Prompt tokens of the blocks bound from the cache, in the group that reused the most."""
        groups = self.manager.spec.groups
        most = max(len(self.manager.get_cached_ordinals(request_id, g.name)) for g in groups)
        return min(prompt_len, most * self.config.tokens_per_block)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
                      first_logprob: TokenLogprob | None = None, num_cached_tokens: int = 0) -> list[RequestUpdate]:
        """Start decoding a request whose prompt KV sits in the pages ``reserve_prefilled`` bound;
        ``first_logprob``: the context side's logprob of ``first_token_id`` (with ``params.logprobs``);
        ``num_cached_tokens``: the context side's prefix-cache hit, reported in usage."""
        if self.manager.num_tokens(request_id) != len(prompt_token_ids):
            raise ValueError(f"request {request_id!r}: reserved {self.manager.num_tokens(request_id)} tokens, "
                             f"prompt has {len(prompt_token_ids)}")
        request = self._new_request(request_id, prompt_token_ids, params)
        request.num_computed_tokens = len(prompt_token_ids)
        request.num_cached_tokens = num_cached_tokens
        self.manager.cache_blocks(request_id, request.block_hashes, request.num_computed_tokens)  # the pull landed
        self.scheduler.add_running(request)
        return [self._advance(request, [first_token_id], [first_logprob])]

    def _new_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     prefill_only: bool = False) -> Request:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        self.check_prompt(len(prompt_token_ids))
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        generator = None if params.is_greedy else torch.Generator(device="cpu")
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), generator,
                          prefill_only, seed)
        request.block_hashes = self._prompt_hashes(request.prompt_token_ids)
        decoder = IncrementalDecoder(self.tokenizer, prompt_ids=prompt_token_ids)
        self._requests[request_id] = request
        self._stoppers[request_id] = StopChecker(request, decoder, self.tokenizer.eos_token_ids, self.max_model_len)
        return request

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
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """Schedule, run the model, postprocess: one update per request that sampled."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        updates = self._postprocess(scheduled, self.runner.run(scheduled))
        if self.scheduler.draft_policy is not None:  # whole steps: drafting and verifying cost Python time too
            self.scheduler.draft_policy.record_step(scheduled, time.perf_counter() - start)
        return updates

    def _postprocess(self, scheduled: list[ScheduledRequest], output: RunOutput) -> list[RequestUpdate]:
        sampled = sample_batch(self.sampler, scheduled, output)
        updates = []
        for i, (item, span) in enumerate(zip(scheduled, output.spans)):
            request = item.request
            request.num_computed_tokens += item.num_new_tokens
            if span is None:  # a prefill chunk short of the prompt's end: nothing to sample yet
                self._cache_computed(request)
                self.manager.release_stale(request.request_id, request.num_computed_tokens)
            elif item.draft_token_ids:
                updates.append(self._advance(request, *self._verify(item, output.logits[span[0]:span[1]])))
            else:
                updates.append(self._advance(request, [sampled.token_ids[i]], [sampled.logprobs[i]]))
        return updates

    def _verify(self, item: ScheduledRequest, rows: torch.Tensor) -> tuple[list[int], list[TokenLogprob | None]]:
        """The verified drafts plus one token."""
        request = item.request
        result = self.sampler.verify(rows, item.draft_token_ids, request.params, request.generator,
                                     reseed=lambda row: seed_for_output(request, ahead=row))
        request.num_drafts_proposed += len(item.draft_token_ids)
        request.num_drafts_accepted += result.num_accepted
        self.num_drafts_proposed += len(item.draft_token_ids)
        self.num_drafts_accepted += result.num_accepted
        request.num_computed_tokens += result.num_accepted
        return result.token_ids, result.logprobs

    def _advance(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> RequestUpdate:
        """Append sampled tokens, then finish, park or keep running the request.

        The one place a request ends from inside: finish frees its pages, park
        (prefill-only, after its first token) keeps them, and a request that
        runs on releases the window pages no future query reads.
        """
        before = request.num_output_tokens
        reason = self._stoppers[request.request_id].add_tokens(token_ids, logprobs)
        # Tokens computed past a stop are dropped: computed never exceeds the kept tokens.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        self._cache_computed(request)
        if request.prefill_only:
            self.scheduler.park(request)
            return self._update(request, before, None, self._prefill_result(request, reason))
        update = self._update(request, before, reason)
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

    def _prefill_result(self, request: Request, reason: FinishReason | None) -> PrefillResult:
        rid, manager = request.request_id, self.manager
        return PrefillResult(
            request_id=rid,
            num_prompt_tokens=request.num_prompt_tokens,
            first_token_id=request.output_token_ids[0],
            first_logprob=request.output_logprobs[0],
            block_ordinals={g.name: manager.get_block_ordinals(rid, g.name) for g in manager.spec.groups},
            finish_reason=reason,
            num_cached_tokens=request.num_cached_tokens,
        )

    def _update(self, request: Request, before: int, reason: FinishReason | None,
                prefill: PrefillResult | None = None) -> RequestUpdate:
        stopper = self._stoppers[request.request_id]
        is_finished = (prefill.finish_reason if prefill is not None else reason) is not None  # parked != finished
        return RequestUpdate(
            request_id=request.request_id,
            new_token_ids=request.output_token_ids[before:],
            new_text=stopper.new_text(is_finished),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finish_reason=reason,
            logprobs=request.output_logprobs[before:] if request.params.logprobs is not None else None,
            num_drafts_proposed=request.num_drafts_proposed,
            num_drafts_accepted=request.num_drafts_accepted,
            num_cached_tokens=request.num_cached_tokens,
            prefill=prefill,
        )

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
        existed = self.manager.has_request(request_id)
        self.manager.free(request_id)
        return existed

    def _finish(self, request: Request, reason: FinishReason) -> None:
        self.scheduler.finish(request, reason)
        self._requests.pop(request.request_id, None)
        self._stoppers.pop(request.request_id, None)

    def stats(self) -> dict:
        """Counters and gauges for metrics (engine.reports)."""
        return engine_stats(self)

    def routing_stats(self) -> dict:
        """What a KV-aware router weighs besides ``stats()``' page counts (engine.reports)."""
        return routing_stats(self)
