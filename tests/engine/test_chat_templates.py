"""The built-in Gemma chat template (engine.chat_templates) against Gemma's published turn format, string
for string, on the real Gemma 3 270M tokenizer (its GGUF file carries no template)."""

from __future__ import annotations

import pytest

from engine.model_registry import GEMMA3_NAME, resolve_model_path
from engine.tokenizer import Tokenizer

# Gemma's documented format: <bos>, then "<start_of_turn>{user|model}\n{text}<end_of_turn>\n" per turn, the
# system prompt at the head of the first user turn, and "<start_of_turn>model\n" to prompt a reply.
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "knock knock"},
    {"role": "assistant", "content": "who is there"},
    {"role": "user", "content": "Gemma"},
]
EXPECTED = ("<bos><start_of_turn>user\nYou are terse.\n\nknock knock<end_of_turn>\n"
            "<start_of_turn>model\nwho is there<end_of_turn>\n"
            "<start_of_turn>user\nGemma<end_of_turn>\n"
            "<start_of_turn>model\n")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model_path(GEMMA3_NAME))


def test_the_gguf_has_no_template_and_the_built_in_one_renders_gemmas_format(tokenizer):
    assert not tokenizer._hf.chat_template and tokenizer.has_chat_template
    ids = tokenizer.apply_chat_template(CONVERSATION)
    assert tokenizer.decode(ids, skip_special_tokens=False) == EXPECTED
    assert ids[0] == tokenizer._hf.bos_token_id and ids.count(tokenizer._hf.bos_token_id) == 1


def test_without_a_system_message(tokenizer):
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "  Hi  "}])
    assert tokenizer.decode(ids, skip_special_tokens=False) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"


def test_end_of_turn_is_a_stop_token_beside_eos(tokenizer):
    end_of_turn = tokenizer._hf.convert_tokens_to_ids("<end_of_turn>")
    assert end_of_turn != tokenizer._hf.unk_token_id
    assert set(tokenizer.eos_token_ids) == {tokenizer._hf.eos_token_id, end_of_turn}


def test_turns_that_do_not_alternate_are_refused(tokenizer):
    with pytest.raises(ValueError, match="alternate user and assistant"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_completion_prompt_gets_one_bos(tokenizer):
    bos = tokenizer._hf.bos_token_id
    assert tokenizer.encode_prompt("Hello")[0] == bos and tokenizer.encode_prompt("Hello")[1:] == \
        tokenizer.encode("Hello")
    assert tokenizer.encode_prompt("<bos>Hello").count(bos) == 1
