"""Speculative decoding's share of the engine: the drafter, the room its drafts reserve, and what a
verify step keeps.

One-engine speculation (DESIGN.md): the scheduler asks :meth:`Speculation.propose` for up to
``D`` drafts after a request's last token, the model scores them in the same forward pass, and
:meth:`Speculation.verify` keeps the accepted prefix plus one sampled token::

    position:   n      n+1 ...... n+D           n = num_computed_tokens before the step
    step runs:  t(n)   d0 ....... d(D-1)        t(n): the last sampled token; d: drafts (scratch KV)
    kept:              d0 .. d(k-1), x          k = num_accepted; x: the next token (correction or bonus)
    computed after:    n + 1 + k                the rejected drafts' KV stays scratch, rewritten later

A grammar request's drafts are cut at the first token its grammar does not allow, and each verify row
is masked by the grammar's state after the drafts before it (engine.grammar); the matcher is rolled
back to the outputs after both, so a rejected draft is never consumed.

``D`` (``draft_len``) and ``E`` (``num_extra_kv_tokens``) size every request's capacity
(``get_kv_capacity_tokens``); both are fixed when the engine is built. A context engine never
drafts: drafts are not its to hold.
"""

from __future__ import annotations

import torch

from engine.batch_sampling import seed_for_output
from engine.config import EngineConfig
from engine.draft_policy import DraftLengthPolicy
from engine.drafter import make_drafter
from engine.outputs import TokenLogprob
from engine.penalties import verify_histories
from engine.request import Request
from engine.sampler import Sampler, VerifyResult
from engine.scheduler import ScheduledRequest


class Speculation:
    """The drafter of an engine that drafts (None otherwise), its draft-length policy, and the
    engine's running counts of drafts proposed and accepted."""

    def __init__(self, config: EngineConfig, *, is_drafting: bool, sampler: Sampler) -> None:
        is_drafting = is_drafting and config.max_draft_len > 0
        self.drafter = make_drafter(config.drafter, config.max_draft_len) if is_drafting else None
        self.draft_len = self.drafter.max_draft_len if self.drafter else 0
        declared = self.drafter.num_extra_kv_tokens if self.drafter else 0
        self.num_extra_kv_tokens = declared + config.num_extra_kv_tokens
        self.policy = DraftLengthPolicy(self.draft_len) if self.drafter else None
        self.sampler = sampler
        self.num_drafts_proposed = 0
        self.num_drafts_accepted = 0

    def propose(self, request: Request, max_len: int) -> list[int]:
        """Up to ``max_len`` drafts; a grammar request's are cut at the first its grammar does not allow."""
        drafts = self.drafter.propose(request.all_token_ids, max_len) if max_len > 0 else []
        if drafts and request.grammar is not None:
            drafts = drafts[:request.grammar.num_valid(request.output_token_ids, drafts)]
        return drafts

    def verify(self, item: ScheduledRequest, rows: torch.Tensor,
               result: VerifyResult | None) -> tuple[list[int], list[TokenLogprob | None]]:
        """The verified drafts plus one token (``result``: verified on the device already, a grammar
        request's rows masked there: engine.gpu.static_runner); the accepted drafts count as computed."""
        request = item.request
        if result is None:
            has_processors = request.params.has_processors
            masks = request.grammar.verify_masks(request.output_token_ids, item.draft_token_ids, rows.shape[-1]) \
                if request.grammar is not None else None
            result = self.sampler.verify(rows, item.draft_token_ids, request.params, request.generator,
                                         reseed=lambda row: seed_for_output(request, ahead=row),
                                         key=(request.seed, request.num_output_tokens),
                                         histories=verify_histories(request, item.draft_token_ids)
                                         if has_processors else None, masks=masks)
        request.num_drafts_proposed += len(item.draft_token_ids)
        request.num_drafts_accepted += result.num_accepted
        if self.policy is not None:
            self.policy.record_verify(len(item.draft_token_ids), result.num_accepted)
        self.num_drafts_proposed += len(item.draft_token_ids)
        self.num_drafts_accepted += result.num_accepted
        request.num_computed_tokens += result.num_accepted
        return result.token_ids, result.logprobs
