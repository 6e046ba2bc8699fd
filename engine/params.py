"""Sampling parameters: what a caller asks of one request."""

from __future__ import annotations

from dataclasses import dataclass

MIN_TEMPERATURE = 1e-5  # vLLM's sampling epsilon


@dataclass(frozen=True)
class SamplingParams:
    """vLLM-style sampling parameters, validated on construction.

    ``temperature < MIN_TEMPERATURE`` means greedy (smaller ones overflow the
    scaled logits). ``top_k <= 0`` means no top-k cut.
    ``seed`` makes a sampled request reproducible on its own, whatever it is
    batched with. ``logprobs`` asks for the chosen token's log-probability
    plus that many top alternatives per generated token (0 = chosen only).
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

    @property
    def is_greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
