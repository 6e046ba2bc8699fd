"""Stop conditions and streamed text for one request, and the updates that carry them."""

from __future__ import annotations

from engine.outputs import FinishReason, PrefillResult, RequestUpdate
from engine.request import Request
from engine.tokenizer import IncrementalDecoder


class StopChecker:
    """Appends sampled tokens to a request and decides when it ends.

    Stops on EOS (unless ``ignore_eos``), a stop token id, ``max_tokens``,
    ``max_model_len``, or a stop string; a stop string and everything after
    it is cut from the text. Until more than ``min_tokens`` outputs are out
    no stop string counts (vLLM's rule; EOS and stop ids cannot be sampled
    before ``min_tokens``: engine.penalties masks them). Text that could still
    grow into a stop string is held back from streaming until it cannot.
    """

    def __init__(self, request: Request, decoder: IncrementalDecoder, eos_token_ids: tuple[int, ...],
                 max_model_len: int) -> None:
        self.request = request
        self.decoder = decoder
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.hold_back = max((len(s) for s in request.params.stop), default=1) - 1
        self.is_cut = False

    def add_tokens(self, token_ids: list[int], logprobs: list) -> FinishReason | None:
        """Append tokens one by one until one ends the request; return the finish reason or None."""
        request, params = self.request, self.request.params
        for token_id, logprob in zip(token_ids, logprobs):
            request.output_token_ids.append(token_id)
            request.output_logprobs.append(logprob)
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in params.stop_token_ids:
                return FinishReason.STOP
            text_before = len(request.text)
            request.text += self.decoder.push(token_id)
            if params.stop and request.num_output_tokens > params.min_tokens and self._cut_at_stop_string(
                    text_before if params.min_tokens else 0):
                return FinishReason.STOP
            if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
                return FinishReason.LENGTH
        return None

    def _cut_at_stop_string(self, new_from: int) -> bool:
        """``new_from``: where this token's text starts; a stop string must end past it (with min_tokens,
        one that ended before min_tokens tokens were out no longer counts)."""
        text = self.request.text
        search_from = max(0, len(self.request.emitted_text) - self.hold_back, new_from - self.hold_back)
        hits = [i for i in (text.find(s, search_from) for s in self.request.params.stop) if i >= 0]
        if not hits:
            return False
        self.request.text = text[:min(hits)]
        self.is_cut = True
        return True

    def new_text(self, is_finished: bool) -> str:
        """Text not yet streamed that can no longer become part of a stop string."""
        request = self.request
        if is_finished and not self.is_cut:
            request.text += self.decoder.flush()
        end = len(request.text) if is_finished else max(len(request.emitted_text), len(request.text) - self.hold_back)
        piece = request.text[len(request.emitted_text):end]
        request.emitted_text += piece
        return piece

    def take_update(self, reason: FinishReason | None, prefill: PrefillResult | None = None) -> RequestUpdate:
        """The outputs since the request's previous update (all of them in its first)."""
        request, before = self.request, self.request.num_emitted_tokens
        request.num_emitted_tokens = request.num_output_tokens
        is_finished = (prefill.finish_reason if prefill is not None else reason) is not None  # parked != finished
        return RequestUpdate(
            request_id=request.request_id,
            new_token_ids=request.output_token_ids[before:],
            new_text=self.new_text(is_finished),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            finish_reason=reason,
            logprobs=request.output_logprobs[before:] if request.params.logprobs is not None else None,
            num_drafts_proposed=request.num_drafts_proposed,
            num_drafts_accepted=request.num_drafts_accepted,
            num_cached_tokens=request.num_cached_tokens,
            prefill=prefill,
        )
