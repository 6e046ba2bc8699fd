"""Tokenizer wrapper and streaming detokenizer, on windserve-tiny's byte-level tokenizer."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from engine.tiny import END_TOKEN, EOS_TOKEN, SPECIAL_TOKENS, VOCAB_SIZE, ensure_tiny_model, token_id
from engine.tokenizer import IncrementalDecoder, Tokenizer

pytest.importorskip("transformers")

# Text as clients send it: any code point but surrogates, and no U+FFFD (which
# would be indistinguishable from an incomplete character).
TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40)
ANY_IDS = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return ensure_tiny_model(str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def tok(tiny_dir) -> Tokenizer:
    return Tokenizer(tiny_dir)


def stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    decoder = IncrementalDecoder(tok, skip_special_tokens=skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_vocab_and_eos(tok):
    assert tok.vocab_size == VOCAB_SIZE == 256 + len(SPECIAL_TOKENS)
    assert tok.eos_token_ids == (token_id(EOS_TOKEN), token_id(END_TOKEN))
    assert tok.pad_token_id == token_id("<|pad|>")


def test_ids_are_utf8_bytes(tok):
    assert tok.encode("a€") == [0x61, 0xE2, 0x82, 0xAC]
    assert tok.encode("x<|end|>") == [ord("x"), token_id(END_TOKEN)]


def test_decode_skips_special_tokens_unless_asked(tok):
    ids = [ord("h"), token_id(END_TOKEN), ord("i")]
    assert tok.decode(ids) == "hi"
    assert tok.decode(ids, skip_special_tokens=False) == "h<|end|>i"


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_encode_decode_round_trips(tok, text):
    assume(not any(special in text for special in SPECIAL_TOKENS))  # those encode to one id (test above)
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_stream_emits_each_character_as_soon_as_it_is_complete(tok, text):
    data = text.encode("utf-8")
    decoder = IncrementalDecoder(tok)
    emitted = ""
    for k, byte in enumerate(data, start=1):
        emitted += decoder.push(byte)
        # Exactly the whole characters among the first k bytes: never half of one.
        assert emitted == data[:k].decode("utf-8", errors="ignore")
    assert decoder.flush() == ""
    assert emitted == text


@settings(max_examples=300, deadline=None)
@given(ids=ANY_IDS, skip=st.booleans())
def test_stream_concatenates_to_decode_for_any_ids(tok, ids, skip):
    """Invalid UTF-8 and special tokens included: the pieces still add up to decode()."""
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None)
@given(ids=ANY_IDS, skip=st.booleans())
def test_decode_is_transformers_decode(tok, ids, skip):
    """decode() calls the Rust tokenizer directly: the same text as transformers' decode, clean-up off."""
    expected = tok._hf.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tok.decode(ids, skip_special_tokens=skip) == expected


def test_stream_holds_an_incomplete_character_until_flush(tok):
    decoder = IncrementalDecoder(tok)
    assert [decoder.push(b) for b in "€".encode()[:2]] == ["", ""]
    assert decoder.flush() == tok.decode(list("€".encode()[:2])) == "\ufffd"


def test_stream_after_a_prompt_emits_only_generated_text(tok):
    prompt = tok.encode("prompt: é")
    generated = tok.encode(" 東京")
    decoder = IncrementalDecoder(tok, prompt_ids=prompt)
    assert "".join(decoder.push(i) for i in generated) + decoder.flush() == " 東京"


def test_chat_template_renders_roles_and_generation_prompt(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "2+2?"},
    ]
    ids = tok.apply_chat_template(messages)
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|start|><|system|>Be brief.<|end|>"
        "<|start|><|user|>Hi there<|end|>"
        "<|start|><|assistant|>Hello.<|end|>"
        "<|start|><|user|>2+2?<|end|>"
        "<|start|><|assistant|>"
    )
    assert ids[-2:] == [token_id("<|start|>"), token_id("<|assistant|>")]
    assert tok.decode(ids) == "Be brief.Hi thereHello.2+2?"


def test_chat_template_rejects_unknown_roles(tok):
    with pytest.raises(ValueError, match="tool"):
        tok.apply_chat_template([{"role": "tool", "content": "42"}])


def test_model_without_chat_template_raises_value_error(tiny_dir, tmp_path):
    plain = shutil.copytree(tiny_dir, tmp_path / "plain")
    config_path = os.path.join(plain, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    tok = Tokenizer(str(plain))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
