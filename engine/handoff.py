"""When a prefill-only request hands over, and what it hands over.

A context worker decodes a prefill-only request past token 0 while its text is
still invisible (a byte-level model may sample half a UTF-8 character first:
the detokenizer holds it back), so the client's first visible text comes in the
context worker's update, not after the generation side's transfer and decode.
It parks once the text is visible, the request finishes, or it has
``HANDOFF_MAX_TOKENS`` outputs. With k outputs t0..t(k-1) handed over::

    position:  0 ........ P-1 | P ..... P+k-2 | P+k-1
    token:     prompt         | t0 ... t(k-2) | t(k-1)
    KV:        computed here, sent             | computed by the generation side's first decode
               <---- num_kv_tokens = P + k - 1 ---->

k = 1 is the plain handoff (KV of the prompt, token 0 pending). Everything that
sizes the transfer (``kvcache.slicing``, the generation side's reservation and
prefix-cache hashes) counts ``num_kv_tokens`` (``engine.outputs.num_kv_tokens``),
never the prompt alone.
"""

from __future__ import annotations

from engine.outputs import FinishReason, PrefillResult
from engine.request import Request
from kvcache import KVCacheManager

# A cap on the context worker's extra decode steps: each one delays token 0 on the wire by a
# decode, and a character takes at most 4 UTF-8 bytes (so a byte-level model shows text by then).
# 1 hands over at token 0, as before multi-token handoffs.
HANDOFF_MAX_TOKENS = 4


def kv_token_ids(prompt_token_ids: list[int], output_token_ids: list[int]) -> list[int]:
    """The ids of the ``num_kv_tokens`` tokens (the generation side names its reserved blocks by them)."""
    return list(prompt_token_ids) + list(output_token_ids[:-1])


def is_handoff_due(request: Request, num_held_back_chars: int, reason: FinishReason | None) -> bool:
    """Park now: the request finished, or its next update would carry text, or it hit the cap.

    ``num_held_back_chars``: the stop-string hold-back (``StopChecker.hold_back``); text
    beyond it is what an update streams.
    """
    is_visible = len(request.text) > num_held_back_chars
    return reason is not None or is_visible or request.num_output_tokens >= HANDOFF_MAX_TOKENS


def prefill_result(request: Request, manager: KVCacheManager, reason: FinishReason | None) -> PrefillResult:
    """The parked request's outputs and its block tables (by ordinal) at parking time."""
    rid = request.request_id
    return PrefillResult(
        request_id=rid,
        num_prompt_tokens=request.num_prompt_tokens,
        output_token_ids=list(request.output_token_ids),
        output_logprobs=list(request.output_logprobs),
        block_ordinals={g.name: manager.get_block_ordinals(rid, g.name) for g in manager.spec.groups},
        finish_reason=reason,
        num_cached_tokens=request.num_cached_tokens,
    )


def reused_tokens(manager: KVCacheManager, request_id: str, num_tokens: int) -> int:
    """Reserved tokens of the blocks bound from the cache, in the group that reused the most."""
    most = max(len(manager.get_cached_ordinals(request_id, g.name)) for g in manager.spec.groups)
    return min(num_tokens, most * manager.spec.tokens_per_block)
