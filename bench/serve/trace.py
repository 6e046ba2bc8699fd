"""The trace: a seeded list of requests, the same bytes for the same arguments.

    arrivals   rate R: Poisson, exponential gaps of mean 1/R; no rate: all at time 0
    lengths    uniform in [len * (1 - spread), len * (1 + spread)]
    mix long-short: mostly short prompts; a ``long_fraction`` of them ``long_input_len`` long,
               arriving among the short requests' running decodes (never the first request)

Each request asks for an exact output length (``max_tokens`` + ``ignore_eos``).
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float
    prompt: str
    max_tokens: int
    is_long: bool = False


def spread_lengths(rng: random.Random, length: int, spread: float, num: int) -> list[int]:
    low, high = max(1, round(length * (1 - spread))), max(1, round(length * (1 + spread)))
    return [rng.randint(low, high) for _ in range(num)]


def random_text(rng: random.Random, num_chars: int) -> str:
    """Lowercase letters and spaces: one token each on a byte tokenizer (windserve-tiny)."""
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(num_chars))


def make_trace(num_requests: int, input_len: int, output_len: int, spread: float = 0.25, *, seed: int = 0,
               rate: float | None = None, mix: str = "none", long_input_len: int = 1500,
               long_fraction: float = 0.1) -> list[RequestSpec]:
    """The same arguments and seed give the same requests, byte for byte."""
    rng = random.Random(seed)
    inputs = spread_lengths(rng, input_len, spread, num_requests)
    outputs = spread_lengths(rng, output_len, spread, num_requests)
    is_long = [mix == "long-short" and i > 0 and rng.random() < long_fraction for i in range(num_requests)]
    arrival, trace = 0.0, []
    for i in range(num_requests):
        if rate is not None and i > 0:
            arrival += rng.expovariate(rate)
        length = spread_lengths(rng, long_input_len, spread, 1)[0] if is_long[i] else inputs[i]
        trace.append(RequestSpec(i, arrival, random_text(rng, length), outputs[i], is_long[i]))
    return trace
