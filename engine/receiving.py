"""The generation side's entry points: a request whose prompt another worker prefilled.

    context worker: prefill ─► park (pages kept, PrefillResult: k outputs, block ordinals)
                                   │ KV of num_kv_tokens = P + k - 1 positions, moved by ordinal
    generation:  reserve_prefilled ─► (transport writes the pages) ─► add_prefilled ─► decode
                 ... the transfer failed ───────────────────────────► resume: recompute, then decode

``reserve_prefilled`` binds the pages a transfer will write (blocks this cache
already holds are bound from it and skipped by the transfer); ``add_prefilled``
starts decoding once they are written; ``resume`` starts a request whose KV never
arrived, replaying the k handed-over outputs in place of its own draws so the
continuation is the one a transfer gives. ``LLMEngine`` takes these methods from
``ReceivingEntries``; they use only its manager, scheduler and request bookkeeping.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.handoff import reused_tokens
from engine.outputs import RequestUpdate, TokenLogprob, num_kv_tokens
from engine.params import SamplingParams
from kvcache import extend_block_hashes

if TYPE_CHECKING:
    from engine.engine import LLMEngine


class ReceivingEntries:
    """``LLMEngine``'s methods for requests whose KV comes from (or was meant to come from) a transfer."""

    def reserve_prefilled(self: LLMEngine, request_id: str, kv_token_ids: list[int]) -> bool:
        """Bind pages for tokens whose KV will arrive by transfer; False if the cache is full now.

        ``kv_token_ids``: the prompt and all handed-over outputs but the last
        (``engine.handoff.kv_token_ids``). Blocks this cache already holds are
        bound from it (``manager.get_cached_ordinals``): a transfer skips them.
        """
        self._check_new_id(request_id)
        num_kv = len(kv_token_ids)
        kwargs = dict(num_computed_tokens=num_kv, draft_len=self.draft_len,
                      num_extra_kv_tokens=self.num_extra_kv_tokens, block_hashes=self._prompt_hashes(kv_token_ids))
        if not self.manager.can_allocate(num_kv, **kwargs):
            return False
        self.manager.allocate(request_id, num_kv, **kwargs)
        self.num_transfer_queried_tokens += num_kv
        self.num_transfer_hit_tokens += reused_tokens(self.manager, request_id, num_kv)
        return True

    def _prompt_hashes(self: LLMEngine, token_ids: list[int]) -> list[bytes]:
        if not self.manager.enable_prefix_caching:
            return []
        return extend_block_hashes([], token_ids, self.config.tokens_per_block, self.hash_extra)

    def add_prefilled(self: LLMEngine, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                      params: SamplingParams, logprobs: list[TokenLogprob | None] | None = None,
                      num_cached_tokens: int = 0) -> list[RequestUpdate]:
        """Start decoding a request whose KV (prompt and outputs but the last) sits in the pages
        ``reserve_prefilled`` bound. Its first update repeats the handed-over outputs (the stop
        checks and text see them all); ``logprobs``: the context side's, one per output;
        ``num_cached_tokens``: the context side's prefix-cache hit, reported in usage."""
        num_kv = num_kv_tokens(len(prompt_token_ids), len(output_token_ids))
        if not output_token_ids or self.manager.num_tokens(request_id) != num_kv:
            raise ValueError(f"request {request_id!r}: reserved {self.manager.num_tokens(request_id)} tokens, "
                             f"the handoff has {num_kv} ({len(output_token_ids)} outputs)")
        request = self._new_request(request_id, prompt_token_ids, params)
        request.num_computed_tokens = num_kv
        request.num_cached_tokens = num_cached_tokens
        self.scheduler.add_running(request)  # _advance names the landed blocks for the prefix cache
        return [self._advance(request, list(output_token_ids), logprobs or [None] * len(output_token_ids))]

    def resume(self: LLMEngine, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
               params: SamplingParams, logprobs: list[TokenLogprob | None] | None = None) -> None:
        """Queue a request whose first k outputs were sampled elsewhere and whose KV is not here
        (a handoff whose transfer failed). It runs the steps the context side ran (prefill,
        then decodes), keeping the given outputs in place of its draws (``engine.batch_sampling``),
        so the continuation is the one a transfer gives; its first update carries all k."""
        request = self._new_request(request_id, prompt_token_ids, params)
        request.given_outputs = list(zip(output_token_ids, logprobs or [None] * len(output_token_ids), strict=True))
        self.scheduler.add(request)
