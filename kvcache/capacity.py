"""The one definition of a request's KV capacity, and block arithmetic on it."""

from __future__ import annotations


def get_kv_capacity_tokens(
    prompt_len: int,
    draft_len: int = 0,
    num_extra_kv_tokens: int = 0,
    *,
    include_drafts: bool = True,
) -> int:
    """KV slots a request needs: ``prompt_len + draft_len + num_extra_kv_tokens``.

    ``prompt_len`` counts tokens whose KV the request holds (or is computing
    this step); ``draft_len`` is the speculative scratch a generation side
    reserves; ``num_extra_kv_tokens`` are the drafter's declared extra slots.
    The context side passes ``include_drafts=False``: drafts are not its to
    hold. Every caller that needs a request's KV size calls this; nothing adds
    these terms by hand.
    """
    for name, value in (
        ("prompt_len", prompt_len),
        ("draft_len", draft_len),
        ("num_extra_kv_tokens", num_extra_kv_tokens),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    return prompt_len + (draft_len if include_drafts else 0) + num_extra_kv_tokens


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_blocks(num_tokens: int, tokens_per_block: int) -> int:
    """Blocks needed to hold ``num_tokens`` positions: ``ceil(num_tokens / B)``."""
    return cdiv(num_tokens, tokens_per_block)
