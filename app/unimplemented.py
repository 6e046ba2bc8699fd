"""Request fields that would change the answer and that windserve does not implement.

Each is accepted only absent, ``null``, or at the value that asks for nothing; anything else is a
400 naming the field (app.protocol raises it), never a 200 whose answer disregards it. Fields that
cannot change the answer (``user``, ``metadata``, ``store`` ...) are not listed: they stay ignored.
docs/openai_fields.md lists every field and what happens to it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class Unimplemented(NamedTuple):
    """``is_neutral(value)``: the value asks for nothing windserve lacks; ``reason``: the 400's message."""

    is_neutral: Callable[[object], bool]
    reason: str


def _never(value: object) -> bool:
    return False


def _equals(*neutral: object) -> Callable[[object], bool]:
    return lambda value: any(value == n and type(value) is type(n) for n in neutral)


# Both endpoints (OpenAI's shared fields and vLLM's extensions).
COMMON: dict[str, Unimplemented] = {
    "best_of": Unimplemented(_equals(1), "only best_of=1 is supported"),
    "echo": Unimplemented(_equals(False), "echo is not supported"),
    "min_p": Unimplemented(_equals(0, 0.0), "min_p is not supported"),
    "use_beam_search": Unimplemented(_equals(False), "beam search is not supported"),
    "guided_whitespace_pattern": Unimplemented(_never, "guided_whitespace_pattern is not supported (JSON is compact)"),
    "bad_words": Unimplemented(_equals([]), "bad_words is not supported"),
    "allowed_token_ids": Unimplemented(_never, "allowed_token_ids is not supported"),
    "logits_processors": Unimplemented(_equals([]), "custom logits processors are not supported"),
    "include_stop_str_in_output": Unimplemented(_equals(False), "include_stop_str_in_output is not supported"),
    "skip_special_tokens": Unimplemented(_equals(True), "special tokens are always skipped in the text"),
    "truncate_prompt_tokens": Unimplemented(_never, "truncate_prompt_tokens is not supported"),
    "prompt_logprobs": Unimplemented(_never, "prompt_logprobs is not supported"),
}

CHAT: dict[str, Unimplemented] = COMMON | {
    "functions": Unimplemented(_equals([]), "function calling is not supported"),
    "function_call": Unimplemented(_equals("none"), "function calling is not supported (only \"none\")"),
    "audio": Unimplemented(_never, "audio output is not supported"),
    "modalities": Unimplemented(_equals(["text"]), "only the text modality is supported"),
    "reasoning_effort": Unimplemented(_never, "reasoning_effort is not supported by this model"),
    "verbosity": Unimplemented(_never, "verbosity is not supported by this model"),
    "web_search_options": Unimplemented(_never, "web search is not supported"),
    "chat_template": Unimplemented(_never, "a request's own chat_template is not supported"),
    "chat_template_kwargs": Unimplemented(_equals({}), "chat_template_kwargs is not supported"),
    "add_generation_prompt": Unimplemented(_equals(True), "the generation prompt is always added"),
    "continue_final_message": Unimplemented(_equals(False), "continue_final_message is not supported"),
    "documents": Unimplemented(_never, "documents are not supported"),
}

COMPLETION: dict[str, Unimplemented] = COMMON | {
    "suffix": Unimplemented(_equals(""), "suffix (insertion) is not supported"),
}


def first_unimplemented(data: dict, table: dict[str, Unimplemented]) -> tuple[str, str] | None:
    """(field, reason) of the first field of ``data`` that asks for what ``table`` lists; None if none."""
    for name, rule in table.items():
        value = data.get(name)
        if value is not None and not rule.is_neutral(value):
            return name, rule.reason
    return None
