"""What the engine reports about a request as it runs."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a request ended; a ``str``, so ``== "stop"`` and JSON see the plain value.

    ``STOP``: EOS, a stop token or a stop string. ``LENGTH``: ``max_tokens`` or
    ``max_model_len``. ``ABORT``: cancelled. ``ERROR``: the engine failed it.
    """

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"

    # A str-mixin Enum would print as "FinishReason.STOP"; enum.StrEnum fixes that only from Python 3.11.
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def num_kv_tokens(num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Tokens whose KV a handoff of ``num_output_tokens`` outputs carries (``engine.handoff``):
    the prompt and every output but the last, whose KV the receiving side computes."""
    return num_prompt_tokens + num_output_tokens - 1


@dataclass(frozen=True)
class PrefillResult:
    """A prefill-only request parked after its handoff, its pages kept for a transfer.

    ``output_token_ids`` (k >= 1) and ``output_logprobs`` (one each, None where
    not asked for): what it sampled before parking (``engine.handoff``); the KV
    of ``num_kv_tokens = P + k - 1`` tokens (the prompt and all outputs but the
    last) is written. ``block_ordinals[group]`` is the manager's table at parking
    time: entry ``i`` is the page holding positions ``[i*B, (i+1)*B)``, -1 where
    none is bound. ``finish_reason`` is set when an output already ends the
    request (``STOP`` or ``LENGTH``): a caller may then finish it without a
    generation worker, and must still ``abort`` it to free the pages.
    """

    request_id: str
    num_prompt_tokens: int
    output_token_ids: list[int]
    output_logprobs: list[TokenLogprob | None]
    block_ordinals: dict[str, list[int]]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.output_token_ids:
            raise ValueError("a prefill hands over at least one output token")
        if len(self.output_logprobs) != len(self.output_token_ids):
            raise ValueError(f"{len(self.output_logprobs)} logprobs for {len(self.output_token_ids)} output tokens")

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV is written: the prompt and every output but the last."""
        return num_kv_tokens(self.num_prompt_tokens, len(self.output_token_ids))


@dataclass
class RequestUpdate:
    """New output of one request since its previous update.

    ``finish_reason`` is None while the request runs, then a ``FinishReason``
    (``error`` says why for ``ERROR``). A prefill-only request's last update
    has ``prefill`` set instead: it is parked, not finished, and its
    ``finish_reason`` stays None (see ``PrefillResult.finish_reason``).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    num_cached_tokens: int = 0
    prefill: PrefillResult | None = None

    @property
    def is_finished(self) -> bool:
        """No update follows this one: the request finished, or it is parked after its prefill."""
        return self.finish_reason is not None or self.prefill is not None


@dataclass
class RequestOutput:
    """A finished request, as the offline ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


def without_first_token(first: RequestUpdate, update: RequestUpdate) -> RequestUpdate:
    """The generation stream's first update less the k outputs the context side already sent.

    ``add_prefilled`` (or, after a failed transfer, ``resume``) advances the generation
    engine with those k outputs, so its first update repeats them: same ids, logprobs,
    and text (held back alike). Only what follows passes on: later tokens, its finish
    or error, and text a finish flushed past ``first``'s.
    """
    k = len(first.new_token_ids)
    if update.new_token_ids[:k] != first.new_token_ids:
        return update
    text = update.new_text[len(first.new_text):] if update.new_text.startswith(first.new_text) else ""
    logprobs = update.logprobs[k:] if update.logprobs is not None else None
    return dataclasses.replace(update, new_token_ids=update.new_token_ids[k:], new_text=text, logprobs=logprobs)
