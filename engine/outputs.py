"""What the engine reports about a request as it runs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """Log-probability of one generated token, with the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestUpdate:
    """New output of one request since its previous update.

    ``finish_reason`` is None while the request runs, then one of
    ``"stop"`` (EOS, stop token or stop string), ``"length"`` (max_tokens or
    max_model_len), ``"abort"`` (cancelled), ``"error"`` (``error`` says why).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A finished request, as the offline ``LLM.generate`` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    metrics: dict = field(default_factory=dict)
