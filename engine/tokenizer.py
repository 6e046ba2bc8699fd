"""Text <-> token ids for a local model directory, and streaming detokenization."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from engine.chat_templates import builtin_chat

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept as context for the first generated ids, so that
# context-dependent decoders (SentencePiece's leading space) render them as
# they would in the full text.
NUM_PROMPT_CONTEXT_IDS = 5


class Tokenizer:
    """A transformers fast tokenizer loaded from a local directory, with the calls windserve needs."""

    def __init__(self, model_path: str):
        from transformers import AutoTokenizer

        self.model_path = model_path
        self._hf = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        # What a fast tokenizer's decode runs when clean-up is off, minus transformers' per-call
        # wrapping (~4x the Rust call for one token); streaming decodes twice per generated token.
        self._backend = getattr(self._hf, "backend_tokenizer", None)
        builtin = None if self._hf.chat_template else builtin_chat(_model_type(model_path))
        self.chat_template: str | None = self._hf.chat_template or (builtin and builtin.template)
        stop_ids = [self._hf.convert_tokens_to_ids(token) for token in (builtin.stop_tokens if builtin else ())]
        stop_ids = [i for i in stop_ids if i is not None and i != self._hf.unk_token_id]  # absent from the vocab
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(
            _eos_token_ids(self._hf.eos_token_id, model_path) + tuple(stop_ids)))
        self.adds_bos = _adds_bos(self._hf)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added special tokens included."""
        return len(self._hf)

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer itself (the grammar library reads its vocabulary)."""
        return self._hf

    @property
    def pad_token_id(self) -> int | None:
        return self._hf.pad_token_id

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    @property
    def chat_template_takes_tools(self) -> bool:
        """Whether the template renders a ``tools`` list itself (it reads the variable); else the HTTP
        layer writes the tools into the messages (app.tool_prompt)."""
        return bool(self.chat_template) and _reads_variable(self.chat_template, "tools")

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as written: no BOS/EOS added; special-token text maps to special ids."""
        return self._hf.encode(text, add_special_tokens=False)

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids: ``encode``, after the BOS where the tokenizer asks for one (Gemma's
        does: without it the model writes nonsense) and the text does not start with it already."""
        ids = self.encode(text)
        bos = self._hf.bos_token_id
        return [bos, *ids] if self.adds_bos and ids[:1] != [bos] else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._hf.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Ids of the rendered conversation followed by the assistant's generation prompt; ``tools``
        (OpenAI's function tools) only for a template that takes them.

        Raises ``ValueError`` when the model has no chat template or the
        template rejects the messages (e.g. a role it does not know).
        """
        if not self.has_chat_template:
            raise ValueError(f"the tokenizer of {self.model_path!r} has no chat template; send a plain prompt instead")
        from jinja2 import TemplateError

        try:
            text = self._hf.apply_chat_template(messages, tools=tools, chat_template=self.chat_template,
                                                tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise ValueError(f"cannot render the chat template of {self.model_path!r}: {e}") from e
        return self.encode(text)


def _reads_variable(template: str, name: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        return name in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:  # a tag of transformers' own ({% generation %}): read the text
        return name in template


def _adds_bos(hf_tokenizer) -> bool:
    """Whether the tokenizer puts a BOS before a text it encodes with its special tokens (its post-processor
    says so; transformers 5 no longer reads ``add_bos_token`` back from a GGUF's tokenizer)."""
    bos = hf_tokenizer.bos_token_id
    with_special, plain = (hf_tokenizer.encode("a", add_special_tokens=flag) for flag in (True, False))
    return bos is not None and with_special[:1] == [bos] and plain[:1] != [bos]


def _model_type(model_path: str) -> str | None:
    path = os.path.join(model_path, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("model_type")


def _eos_token_ids(tokenizer_eos: int | None, model_path: str) -> tuple[int, ...]:
    """The tokenizer's EOS, then generation_config.json's (an int or a list), without repeats."""
    ids = [] if tokenizer_eos is None else [tokenizer_eos]
    path = os.path.join(model_path, GENERATION_CONFIG_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            configured = json.load(f).get("eos_token_id")
        ids += configured if isinstance(configured, list) else [] if configured is None else [configured]
    return tuple(dict.fromkeys(ids))


class IncrementalDecoder:
    """Turns generated ids, one at a time, into text pieces for streaming.

    A piece is emitted only when the text decoded so far does not end in an
    incomplete character (U+FFFD), so a multi-byte character split over
    several byte tokens comes out whole. ``push`` pieces followed by
    ``flush()`` concatenate to ``decode(generated ids)``.

    Only a window of ids is re-decoded per step; the last emitted piece's
    ids stay in it as context, so the cost per step does not grow:

        ids:  [ ... | prefix_offset .. read_offset) [read_offset .. end)
                      last emitted piece              not yet emitted
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - NUM_PROMPT_CONTEXT_IDS)

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(full_text[len(prefix_text):])

    def flush(self) -> str:
        """The text still held back (an incomplete character at the end comes out as U+FFFD)."""
        prefix_text, full_text = self._decode_window()
        return self._advance(full_text[len(prefix_text):])

    def _decode_window(self) -> tuple[str, str]:
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special_tokens)
        full = decode(self._ids[self._prefix_offset:], self._skip_special_tokens)
        return prefix, full

    def _advance(self, piece: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return piece
