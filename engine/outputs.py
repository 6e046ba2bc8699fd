"""What the engine reports about a request as it runs."""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from dataclasses import dataclass, field

# ``WINDSERVE_TRACE_PATH=1``: every update carries ``stamps``, time.monotonic() at each hop of the serving
# path (bench.serve_path reads them from the SSE chunks). Off by default: then ``stamps`` stays None and a
# hop's stamp() is one attribute test.
TRACE_PATH_ENV = "WINDSERVE_TRACE_PATH"


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
    stamps: dict[str, float] | None = None  # hop name -> time.monotonic(), only under TRACE_PATH_ENV

    @property
    def is_finished(self) -> bool:
        """No update follows this one: the request finished, or it is parked after its prefill."""
        return self.finish_reason is not None or self.prefill is not None


def is_tracing_path() -> bool:
    return os.environ.get(TRACE_PATH_ENV) == "1"


def stamp(update: RequestUpdate, hop: str) -> None:
    """Record when ``update`` passed ``hop`` (a no-op unless the engine loop started its stamps)."""
    if update.stamps is not None:
        update.stamps[hop] = time.monotonic()


def merge_updates(updates: list[RequestUpdate]) -> RequestUpdate:
    """One update of a request standing for several consecutive ones (a consumer that fell behind).

    Tokens, text and logprobs concatenate in order; counts and the finish come from the last
    (only the last may be finished: nothing follows a finished update)::

        u0: ids [a]    text "x"   logprobs [la]    num_output_tokens 5
        u1: ids [b, c] text "yz"  logprobs [lb, lc] num_output_tokens 7  finish "length"
        ->  ids [a, b, c] text "xyz" logprobs [la, lb, lc] num_output_tokens 7  finish "length"

    ``stamps``: the first update's, so a trace times the oldest token it carries.
    """
    if len(updates) == 1:
        return updates[0]
    if any(u.is_finished for u in updates[:-1]) or len({u.request_id for u in updates}) != 1:
        raise ValueError("merge_updates takes consecutive updates of one request, only the last finished")
    last = updates[-1]
    is_logprobs = any(u.logprobs is not None for u in updates)
    return dataclasses.replace(
        last,
        new_token_ids=[t for u in updates for t in u.new_token_ids],
        new_text="".join(u.new_text for u in updates),
        logprobs=[lp for u in updates for lp in (u.logprobs or ())] if is_logprobs else None,
        stamps=updates[0].stamps,
    )


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
