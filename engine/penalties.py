"""The logits processors that read a request's tokens: penalties, logit bias, min_tokens.

What a row of logits is processed with (engine.gpu.sampling's ``penalize`` does the arithmetic, on
whichever device holds the logits) depends on the tokens before it. For a verify step's rows the
drafts ahead of a row count as outputs, as the sequential decode would have sampled them::

    row            0         1             2 (= k)
    outputs seen   o         o + d0        o + d0 d1       o: the request's outputs so far
    min_tokens     |o|       |o| + 1       |o| + 2          (outputs before the row's token)

A request whose params have no processor (``SamplingParams.has_processors``) costs nothing: the
callers skip this module when no row has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.gpu.sampling import PenaltyRows
from engine.params import SamplingParams
from engine.request import Request


class TokenHistory(NamedTuple):
    """What one row's processors read: the prompt, the outputs before the row's token, and the ids
    ``min_tokens`` masks (the stop token ids, and EOS unless ``ignore_eos``)."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: tuple[int, ...]


def history_of(request: Request, drafts: Sequence[int] = ()) -> TokenHistory:
    """Request's history for its next token, ``drafts`` (accepted ahead of that row) counted as outputs."""
    params = request.params
    stop_ids = params.stop_token_ids + (() if params.ignore_eos else request.eos_token_ids)
    outputs = request.output_token_ids + list(drafts) if drafts else request.output_token_ids
    return TokenHistory(request.prompt_token_ids, outputs, stop_ids)


def verify_histories(request: Request, drafts: Sequence[int]) -> list[TokenHistory]:
    """One history per verify row: row i follows drafts[:i] (the module docstring's table)."""
    return [history_of(request, drafts[:i]) for i in range(len(drafts) + 1)]


def any_processors(params: Sequence[SamplingParams]) -> bool:
    return any(p.has_processors for p in params)


def penalty_rows(params: Sequence[SamplingParams], histories: Sequence[TokenHistory], vocab_size: int,
                 device: torch.device) -> PenaltyRows:
    """``penalize``'s inputs for rows ``params[i]`` / ``histories[i]``, built on ``device`` from flat
    indices (row * V + token id): a few small copies, never a dense tensor through the host.

    Token ids at or past ``vocab_size`` are skipped: the HTTP layer rejects such a logit_bias, and an
    engine caller that slips one through must not fail the whole batch's step."""
    if len(params) != len(histories):
        raise ValueError(f"{len(params)} params but {len(histories)} histories")
    counted, seen, biased, biases = [], [], [], []
    for row, (p, history) in enumerate(zip(params, histories)):
        base = row * vocab_size
        if p.frequency_penalty or p.presence_penalty:
            counted += [base + t for t in history.output_token_ids if t < vocab_size]
        if p.repetition_penalty != 1.0:
            seen += [base + t for t in (*history.prompt_token_ids, *history.output_token_ids) if t < vocab_size]
        bias = dict(p.logit_bias)
        if len(history.output_token_ids) < p.min_tokens:
            bias.update((t, float("-inf")) for t in history.stop_token_ids)
        biased += [base + t for t in bias if t < vocab_size]
        biases += [value for t, value in bias.items() if t < vocab_size]
    shape = (len(params), vocab_size)
    return PenaltyRows(
        bias=_scattered(shape, biased, torch.tensor(biases, dtype=torch.float32), device),
        seen=_scattered(shape, seen, torch.ones(len(seen)), device) > 0,
        counts=_scattered(shape, counted, torch.ones(len(counted)), device),
        repetition=_column([p.repetition_penalty for p in params], device),
        frequency=_column([p.frequency_penalty for p in params], device),
        presence=_column([p.presence_penalty for p in params], device),
    )


def _scattered(shape: tuple[int, int], flat_ids: list[int], values: torch.Tensor,
               device: torch.device) -> torch.Tensor:
    """A float32 [N, V] of zeros with ``values`` summed in at ``flat_ids`` (repeats add up: counts)."""
    dense = torch.zeros(shape[0] * shape[1], dtype=torch.float32, device=device)
    if flat_ids:
        dense.index_add_(0, torch.tensor(flat_ids, dtype=torch.int64).to(device), values.to(device))
    return dense.view(shape)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device)[:, None]
