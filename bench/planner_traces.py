"""Request traces for the planner's simulator (bench.planner_sim): stationary, shifting, burst.

Shapes follow the Azure LLM inference traces of November 2023 (AzurePublicDataset,
``AzureLLMInferenceTrace_code`` and ``_conv``) as the Splitwise paper (Patel et al., ISCA 2024)
characterizes them: code requests have long prompts and very short outputs (median ~1500 prompt
tokens, ~13 output tokens), conversation requests shorter prompts and longer outputs (median
~1020 and ~129). What we take: those medians, drawn log-normally (the traces' long right tails;
the spreads ``sigma`` are our choice), with Poisson arrivals. Not taken: the traces' own
timestamps or per-request lengths (no data is read). Our additions, so the shift is pronounced:
the generation-heavy phase draws conversation prompts with 3x the conversation outputs (long
answers), and prefix-hit shares (code 10%, conversation 30%) are assumptions, not trace figures.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple


class Request(NamedTuple):
    arrival_s: float
    prompt_len: int
    cached_len: int  # prompt tokens found in the prefix cache (not computed)
    output_len: int


class Shape(NamedTuple):
    prompt_median: float
    output_median: float
    hit_share: float
    prompt_sigma: float = 0.6
    output_sigma: float = 0.7


CODE = Shape(prompt_median=1500, output_median=13, hit_share=0.1)
CONVERSATION = Shape(prompt_median=1020, output_median=129, hit_share=0.3)
LONG_ANSWERS = CONVERSATION._replace(output_median=3 * 129)


def draw(shape: Shape, arrival_s: float, rng: random.Random) -> Request:
    prompt = int(min(8000, max(16, rng.lognormvariate(math.log(shape.prompt_median), shape.prompt_sigma))))
    output = int(min(2000, max(1, rng.lognormvariate(math.log(shape.output_median), shape.output_sigma))))
    return Request(arrival_s, prompt, int(prompt * shape.hit_share), output)


def poisson(duration_s: float, rate_at, shape_at, seed: int) -> list[Request]:
    """Arrivals of a Poisson process whose rate (thinning against ``peak``) and shape vary with time."""
    rng = random.Random(seed)
    peak = max(rate_at(t) for t in range(int(duration_s) + 1))
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return requests
        if rng.random() * peak <= rate_at(t):
            requests.append(draw(shape_at(t, rng), t, rng))


def stationary(duration_s: float = 1200, rate: float = 30.0, seed: int = 0) -> list[Request]:
    """Conversation traffic at a constant rate."""
    return poisson(duration_s, lambda t: rate, lambda t, rng: CONVERSATION, seed)


def shifting(duration_s: float = 1200, seed: int = 0) -> list[Request]:
    """Prompt-heavy (code, 24/s) for the first third, a linear mix in the middle third, then
    generation-heavy (long answers, 14/s) for the last third."""
    def share_b(t: float) -> float:
        return min(1.0, max(0.0, (t - duration_s / 3) / (duration_s / 3)))

    def rate(t: float) -> float:
        return 24.0 + (14.0 - 24.0) * share_b(t)

    return poisson(duration_s, rate, lambda t, rng: LONG_ANSWERS if rng.random() < share_b(t) else CODE, seed)


def burst(duration_s: float = 1200, rate: float = 20.0, seed: int = 0) -> list[Request]:
    """Conversation traffic with the rate doubled for a sixth of the trace, from its middle."""
    start, end = duration_s / 2, duration_s / 2 + duration_s / 6
    return poisson(duration_s, lambda t: 2 * rate if start <= t < end else rate, lambda t, rng: CONVERSATION, seed)


TRACES = {"stationary": stationary, "shifting": shifting, "burst": burst}
