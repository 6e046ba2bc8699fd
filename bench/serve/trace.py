"""The trace: a seeded list of requests, the same bytes for the same arguments.

    arrivals   rate R: Poisson, exponential gaps of mean 1/R; no rate: all at time 0
    lengths    uniform in [len * (1 - spread), len * (1 + spread)]
    mix long-short: mostly short prompts; a ``long_fraction`` of them ``long_input_len`` long,
               arriving among the short requests' running decodes (never the first request)

Each request asks for an exact output length (``max_tokens`` + ``ignore_eos``).

``make_chat_trace``: multi-turn chats for prefix caching, in rounds (every
conversation's turn 0, then every turn 1, ...), so a conversation's next turn
always comes after its previous one::

    turn 0    system + Q0
    turn 1    system + Q0 + A0 + Q1         (turn 0's prompt + its answer + a new question)
    turn 2    system + Q0 + A0 + Q1 + A1 + Q2

Most conversations share one system prompt; every ``private_every``-th one
has its own. The answers are seeded text of the requested output length, a
stand-in for the reply: a random-weights model's reply is noise, and seeded
answers keep the trace the same bytes for every endpoint it is sent to.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestSpec:
    index: int
    arrival_s: float
    prompt: str
    max_tokens: int
    is_long: bool = False
    turn: int = 0
    extra_body: dict | None = field(default=None, compare=False)  # more request fields (bench.structured_http)


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


def chat_turn(question: str) -> str:
    return f"\nuser: {question}\nassistant:"


def make_chat_trace(num_conversations: int, num_turns: int, system_len: int, question_len: int, answer_len: int,
                    *, seed: int = 0, private_every: int = 4) -> list[RequestSpec]:
    """Requests in rounds (see the module docstring); the same arguments and seed give the same bytes."""
    rng = random.Random(seed)
    shared_system = random_text(rng, system_len)
    prompts = [shared_system if (c + 1) % private_every else random_text(rng, system_len)
               for c in range(num_conversations)]
    trace = []
    for turn in range(num_turns):
        for c in range(num_conversations):
            if turn > 0:
                prompts[c] += " " + random_text(rng, answer_len - 1)  # the previous turn's answer
            prompts[c] += chat_turn(random_text(rng, question_len))
            trace.append(RequestSpec(len(trace), 0.0, prompts[c], answer_len, turn=turn))
    return trace
