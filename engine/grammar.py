"""Structured outputs: what a request's grammar is, where its matcher stands, and the token masks.

One library does the grammar work, xgrammar, behind this module and engine.grammar_compile (nothing
else imports it). Both candidates measured on this CPU (AMD EPYC, 2 cores, load ~2-3 from other
benchmarks; SmolLM2's 49,152-token vocabulary through each library's Hugging Face tokenizer
integration; ``python -m bench.grammar_libs``, 2026-12-07)::

                         tokenizer tables   compile, 4 schemas    mask fill per token, median (max)
    xgrammar 0.2.9       2.57 s once        1.5 - 23 ms           4 - 6 us  (36 - 130 us)
    llguidance 1.9.1     0.67 s once        1.2 - 1.7 ms (lazy)   54 - 69 us (149 - 362 us)

xgrammar is the one: a mask is filled on the step's critical path once per grammar row per step
(and per verify row), where it costs ~10x less; compiling happens once per schema, off the step
thread, and is cached. It also applies a mask with a native CPU kernel (llguidance's torch helper is
a ``torch.compile`` kernel: a compile on first use), rolls back without limit (drafts), and is
vLLM's and SGLang's default, so its behaviour on odd schemas is the one users know.

A request's matcher is derived from its output tokens, never advanced by hand::

    outputs     t0 t1 t2 t3                 the request's output_token_ids
    accepted    t0 t1 t2                    Matcher.accepted: what the matcher consumed so far
    sync()      rolls back past the first difference, accepts the rest: accepted == outputs

Every use (a mask, a draft check) first syncs, so the matcher has accepted exactly
``len(output_token_ids)`` tokens whatever happened in between: a generation worker's fresh matcher
replays the context side's k handed-over outputs once, on its first mask; a resumed request (a failed
transfer) or a preempted one replays what it has; an accepted draft is consumed when it becomes an
output, a rejected one never is. No path accepts a token twice or skips one. An output the grammar
does not allow cannot come from this engine (every token it samples was masked); one handed over that
the grammar rejects raises GrammarError in the step, which fails the step's requests loudly.

Drafts (engine.speculation): a proposal is cut at its first token the grammar does not allow
(``num_valid``), and a verify step's row ``i`` is masked by the state after drafts ``d0..d(i-1)``
(``verify_masks``, which rolls the matcher back to the outputs afterwards).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "ebnf", "structural_tag")


class GrammarError(ValueError):
    """A grammar that cannot be used: it does not compile, its compile ran past the deadline, or an
    output token is one it does not allow (a handed-over token from a side without the grammar)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint, hashable (the compile cache's key; SamplingParams stay hashable).

    ``kind``: ``json`` (``source``: a JSON schema as JSON text), ``json_object`` (any JSON object),
    ``regex``, ``choice`` (``source``: a JSON list of the allowed strings), ``ebnf`` (xgrammar's
    EBNF, llama.cpp's GBNF format, root rule ``root``) or ``structural_tag`` (``source``: an xgrammar
    structural tag as JSON text; app.tools builds one for tool calls).
    """

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}, got {self.kind!r}")
        if self.kind == "json":
            schema = json.loads(self.source)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            object.__setattr__(self, "source", json.dumps(schema, sort_keys=True))
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.kind == "structural_tag" and not isinstance(json.loads(self.source), dict):
            raise ValueError("a structural tag must be a JSON object")  # kept as sent: key order is property order
        if self.kind in ("regex", "ebnf") and not self.source:
            raise ValueError(f"a {self.kind} grammar must not be empty")

    @classmethod
    def json_schema(cls, schema: Any) -> GrammarSpec:
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))

    def as_ebnf_choice(self) -> str:
        """``choice`` as an EBNF alternation of string literals (JSON's escapes are EBNF's)."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(self.source))


class TokenMasks(NamedTuple):
    """Allowed tokens of the grammar rows of a logits tensor: ``bitmask[i]`` (xgrammar's int32
    bit-packed layout, bit 1 = allowed) masks logits row ``i`` for each ``i`` in ``rows``."""

    bitmask: torch.Tensor
    rows: list[int]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Disallowed tokens of those rows set to -inf, in place; returns ``logits``."""
        import xgrammar

        xgrammar.apply_token_bitmask_inplace(logits, self.bitmask.to(logits.device), indices=self.rows)
        return logits


def new_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """All tokens allowed, ``num_rows`` rows."""
    return torch.full((num_rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class Matcher:
    """One request's place in its grammar (module docstring: derived from its outputs)."""

    def __init__(self, handle) -> None:
        self._handle = handle  # an xgrammar.GrammarMatcher, stop ids set to the request's
        self.accepted: list[int] = []

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Stand after exactly ``output_token_ids``: roll back what differs, accept what is new."""
        same = _common_prefix(self.accepted, output_token_ids)
        if same < len(self.accepted):
            self._handle.rollback(len(self.accepted) - same)
            del self.accepted[same:]
        for token_id in output_token_ids[same:]:
            if not self._handle.accept_token(int(token_id)):
                raise GrammarError(f"output {len(self.accepted)} (token {token_id}) is not allowed by the grammar")
            self.accepted.append(int(token_id))

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed next tokens into ``bitmask[row]`` (all of them once a stop token ended it)."""
        if self._handle.is_terminated():
            bitmask[row] = -1
        else:
            self._handle.fill_next_token_bitmask(bitmask, row)

    def num_valid(self, output_token_ids: Sequence[int], drafts: Sequence[int]) -> int:
        """How many leading ``drafts`` the grammar allows after the outputs (the matcher is left there)."""
        self.sync(output_token_ids)
        num = 0
        for token_id in drafts:
            if self._handle.is_terminated() or not self._handle.accept_token(int(token_id)):
                break
            num += 1
        if num:
            self._handle.rollback(num)
        return num

    def verify_masks(self, output_token_ids: Sequence[int], drafts: Sequence[int], vocab_size: int) -> TokenMasks:
        """One mask per verify row: row ``i`` follows the outputs and ``drafts[:i]`` (all allowed: they
        were cut by ``num_valid``); the matcher is left after the outputs."""
        self.sync(output_token_ids)
        bitmask = new_bitmask(len(drafts) + 1, vocab_size)
        self.fill(bitmask, 0)
        num = 0
        try:
            for i, token_id in enumerate(drafts, 1):
                if self._handle.is_terminated() or not self._handle.accept_token(int(token_id)):
                    raise GrammarError(f"draft {i - 1} (token {token_id}) is not allowed by the grammar")
                num += 1
                self.fill(bitmask, i)
        finally:
            if num:
                self._handle.rollback(num)
        return TokenMasks(bitmask, list(range(len(drafts) + 1)))


def masks_for(matchers: Sequence[Matcher | None], outputs: Sequence[Sequence[int]],
              vocab_size: int) -> TokenMasks | None:
    """Row ``i``'s mask from ``matchers[i]`` after ``outputs[i]``; None when no row has a grammar."""
    rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return None
    bitmask = new_bitmask(len(matchers), vocab_size)
    for i in rows:
        matchers[i].sync(outputs[i])
        matchers[i].fill(bitmask, i)
    return TokenMasks(bitmask, rows)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return next(i for i in range(n) if a[i] != b[i])
