"""Sampling parameters: what a caller asks of one request."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.grammar import GrammarSpec

MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon
MAX_ABS_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties
# repetition_penalty's range: a logit divided by a penalty near 0 overflows to inf (and the row's
# softmax to NaN); vLLM takes any positive value, transformers' users 1.0-1.5
REPETITION_PENALTY_RANGE = (0.01, 100.0)
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters, validated on construction.

    ``temperature < MIN_TEMPERATURE`` means greedy (smaller ones overflow the
    scaled logits). ``top_k <= 0`` means no top-k cut.
    ``seed`` makes a sampled request reproducible on its own, whatever it is
    batched with. ``logprobs`` asks for the chosen token's log-probability
    plus that many top alternatives per generated token (0 = chosen only).

    The logits processors (engine.penalties, applied before greedy and
    sampling alike): ``presence_penalty`` / ``frequency_penalty`` (OpenAI's,
    over the output tokens), ``repetition_penalty`` (vLLM's, over prompt and
    output tokens; 1 = off), ``logit_bias`` (token id -> bias, a dict is kept
    as sorted pairs so the params stay hashable), ``min_tokens`` (EOS and stop
    token ids masked until that many tokens are out).

    ``grammar``: structured outputs (engine.grammar), a token mask applied after the processors.
    The grammar ends the output on EOS or a stop token id, so it needs one it may end on: not with
    ``ignore_eos`` unless ``stop_token_ids`` are given, and not with ``min_tokens`` (which masks
    them: a complete value could then be followed by nothing the grammar allows).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    grammar: GrammarSpec | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._check_processors()
        if self.grammar is not None and self.ignore_eos and not self.stop_token_ids:
            raise ValueError("ignore_eos with structured outputs needs stop_token_ids to end the output on")
        if self.grammar is not None and self.min_tokens:
            raise ValueError("min_tokens is not supported with structured outputs")

    def _check_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_ABS_PENALTY <= getattr(self, name) <= MAX_ABS_PENALTY:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((int(token_id), float(value)) for token_id, value in bias))
        object.__setattr__(self, "logit_bias", bias)
        for token_id, value in bias:
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(f"logit_bias of token {token_id} must be in [-100, 100], got {value}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_processors(self) -> bool:
        """Any logits processor that changes a logit: False costs a request nothing (engine.penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)
