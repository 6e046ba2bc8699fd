"""Small typed messages between workers. No KV data crosses the control plane."""

from __future__ import annotations

from dataclasses import dataclass

from engine.outputs import TokenLogprob


@dataclass(frozen=True)
class KVHandle:
    """Where a prefilled prompt's KV lives, and for how long it is held.

    ``block_ordinals[group]`` is the context side's table for the request
    (entry ``i`` = page holding positions ``[i*B, (i+1)*B)``, -1 where none).
    ``lease_deadline`` is wall-clock seconds (``time.time()``).
    ``first_logprob``: the first token's logprob when the request asked for logprobs.
    """

    context_agent: str
    request_id: str
    prompt_len: int
    first_token_id: int
    block_ordinals: dict[str, list[int]]
    lease_deadline: float
    tokens_per_block: int
    first_logprob: TokenLogprob | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {self.prompt_len}")


@dataclass(frozen=True)
class TransferRecord:
    """What one request's KV transfer moved: reported to metrics and tests."""

    request_id: str
    num_pages: int
    num_descriptors: int
    num_bytes: int
    seconds: float
