"""One request's progress through the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.grammar import Matcher
from engine.outputs import FinishReason, TokenLogprob
from engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PARKED = "parked"  # prefill-only: handed over (engine.handoff), pages kept for a transfer until abort
    FINISHED = "finished"


@dataclass
class Request:
    """Tokens of one request and how far their KV has been computed.

    ``num_computed_tokens`` catches up with ``num_tokens``: the tokens in
    ``[num_computed_tokens, num_tokens)`` are the next to run through the
    model (a prefill chunk, or the one pending sampled token in decode).
    When a step reaches ``num_tokens`` the model's last logits sample the
    next token, which becomes the new pending one.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    generator: torch.Generator | None = None
    prefill_only: bool = False
    seed: int = 0
    eos_token_ids: tuple[int, ...] = ()  # what min_tokens masks beside the stop token ids (engine.penalties)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    given_outputs: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # kept, not drawn (resume)
    grammar: Matcher | None = None  # params.grammar's matcher, synced to output_token_ids on each use
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    block_hashes: list[bytes] = field(default_factory=list)  # names of its full blocks (kvcache.hashing)
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    num_drafts_proposed: int = 0
    num_drafts_accepted: int = 0
    num_emitted_tokens: int = 0  # outputs reported in updates so far
    emitted_text: str = ""
    text: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_replaying(self) -> bool:
        """Its next output was sampled elsewhere (``given_outputs``): this step keeps it instead."""
        return self.num_output_tokens < len(self.given_outputs)

    @property
    def may_draft(self) -> bool:
        """Drafts are verified against this step's logits: not for a prefill-only request (it hands
        over after a few single-token steps, ``engine.handoff``), and not while replaying given
        outputs (the drafts would be checked against a token that is then replaced)."""
        return not self.prefill_only and not self.is_replaying

    def given_or_sampled(self, token_id: int, logprob: TokenLogprob | None) -> tuple[int, TokenLogprob | None]:
        """The given output in place of the sampled one while one is due, else the sampled one."""
        return self.given_outputs[self.num_output_tokens] if self.is_replaying else (token_id, logprob)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
