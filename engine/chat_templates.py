"""Chat templates built in per architecture, for model files that carry none (llama.cpp does the same).

A GGUF file's ``tokenizer.chat_template`` is used whenever it has one. Gemma 3's base-model files have
none, so a chat request would otherwise be refused. The built-in one renders Gemma's published turn
format::

    <bos><start_of_turn>user
    {system}\n\n{first user message}<end_of_turn>
    <start_of_turn>model
    {assistant message}<end_of_turn>
    <start_of_turn>user
    {user message}<end_of_turn>
    <start_of_turn>model

Gemma has no system role: a system message becomes the first user turn's prefix, and the assistant
role is called ``model``. Turns must alternate user / assistant. ``<end_of_turn>`` ends a model turn,
so it is a stop token wherever this template is used.
"""

from __future__ import annotations

from typing import NamedTuple


class BuiltinChat(NamedTuple):
    template: str  # Jinja, as transformers' apply_chat_template renders it
    stop_tokens: tuple[str, ...]  # token texts that end the assistant's turn


GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set turns = messages -%}"
    "{%- set system_prefix = '' -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set system_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Gemma conversations alternate user and assistant turns, starting with user') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (system_prefix if loop.first else '') + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# config.json's model_type -> its built-in chat
BUILTIN_CHATS = {
    "gemma3_text": BuiltinChat(GEMMA_TEMPLATE, ("<end_of_turn>",)),
    "gemma3": BuiltinChat(GEMMA_TEMPLATE, ("<end_of_turn>",)),
}


def builtin_chat(model_type: str | None) -> BuiltinChat | None:
    return BUILTIN_CHATS.get(model_type or "")
